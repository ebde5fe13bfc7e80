"""What hosting a busy attention executor costs the host model's own decode step.

    python bench/remote_host.py --out remote_host.json      # needs two GPUs (kind nvidia-h200-x2)

The host model (Llama-3-8B geometry, dummy weights, decode CUDA graphs) runs on cuda:1 and also hosts
an in-process executor; a sender model on cuda:0 offloads a share of its decode rows there over the
GPU-signalled exchange (`cuda_ipc`). One host thread issues, per iteration, the executor's gated
program, the sender's step and the host model's step, so the GPU sees exactly the concurrent work of
serving both. The host model's step is timed with events on its own stream, alone and while the
executor is busy; the executor's stream has high priority, so its share of cuda:1 is what the host
model loses.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_measure import PAGE, Layout, SplitStep
from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.forward_batch import BatchRow, ForwardBatch, ForwardMode
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.resolve import resolve_model_path
from sglang_ext.offload.executor import AttentionExecutor
from sglang_ext.offload.partition import ForeignKVPartition
from sglang_ext.offload.peer import PeerRemote
from sglang_ext.offload.setup import guest_spec
from sglang_ext.server_args import ServerArgs


def _runner(model: str, device: str, tokens: int) -> ModelRunner:
    model_dir = resolve_model_path(model)
    args = ServerArgs(model_path=model, load_format="dummy", device=device, dtype="bfloat16", page_size=PAGE,
                      max_total_tokens=tokens, cuda_graph_max_bs=256, skip_tokenizer_init=True)
    with torch.cuda.device(device):
        r = ModelRunner(args, model_dir, ModelConfig.from_path(model_dir))
        r.pool.data.normal_()
    return r


def _host_step_ms(host: ModelRunner, batch: ForwardBatch, iters: int, also: Any = None) -> float:
    """Median over iterations of the host model's step on its own stream, with `also()` (the sender's
    step and the executor's program) issued just before it each iteration."""
    dev = host.device
    times = []
    for i in range(iters + 3):
        if also is not None:
            also()
        with torch.cuda.device(dev):
            s = torch.cuda.current_stream(dev)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            host.forward(batch)
            b.record(s)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        if i >= 3:
            times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="preset:llama-3-8b")
    p.add_argument("--host", default="64:2048", help="host model's own batch, bs:ctx")
    p.add_argument("--senders", default="128:2048:0.5,256:2048:0.5",
                   help="sender loads bs:ctx:share (the share's rows attend on the host's GPU)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="remote_host.json")
    a = p.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    hbs, hctx = (int(x) for x in a.host.split(":"))
    senders = [(int(b), int(c), float(s)) for b, c, s in (x.split(":") for x in a.senders.split(","))]
    max_local = max(round(b * (1 - s)) * c for b, c, s in senders)
    max_remote = max(round(b * s) * c for b, c, s in senders)
    host = _runner(a.model_path, "cuda:1", hbs * hctx + 4 * PAGE)
    sender = _runner(a.model_path, "cuda:0", max_local + 4 * PAGE)
    cfg = sender.cfg
    kv_token = sender.pool.geometry.page_bytes // PAGE
    executor = AttentionExecutor(ForeignKVPartition(int(max_remote * kv_token * 1.1) + 2**30, "cuda:1"), "flashinfer")
    remote = PeerRemote(executor, "bench", guest_spec(sender), sender.device, cfg.num_heads, max_rows=256)
    sender.set_remote(remote)
    host_batch = ForwardBatch.build(
        [BatchRow(hctx - 1, [7], pg, [0]) for pg in Layout(host.num_pages).pages(hbs, hctx)],
        ForwardMode.DECODE, PAGE, "cuda:1")
    res: dict[str, Any] = {"env": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                   "gpus": [torch.cuda.get_device_name(i) for i in range(2)],
                                   "torch": torch.__version__, "model": a.model_path, "host": a.host},
                           "rows": []}
    alone = _host_step_ms(host, host_batch, a.iters)
    res["host_alone_ms"] = alone
    print(json.dumps({"host_alone_ms": alone}), flush=True)
    layout = Layout(sender.num_pages)
    for bs, ctx, share in senders:
        row: dict[str, Any] = {"bs": bs, "ctx": ctx, "share": share}
        try:
            n_remote = round(bs * share)
            pages = layout.pages(bs - n_remote, ctx)
            sender_step = SplitStep(sender, remote, executor, "bench", pages, n_remote, ctx).run

            busy = _host_step_ms(host, host_batch, a.iters, sender_step)
            row.update(host_busy_ms=busy, increase=busy / alone - 1)
            executor.release_all("bench")
        except Exception as e:  # record and go on
            row["error"] = f"{type(e).__name__}: {e}"
            executor.release_all("bench")
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
