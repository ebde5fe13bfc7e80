"""What hosting a busy attention executor costs the host model's own decode step, and what capping the
executor's SMs (`executor_max_sms`) buys back.

    python bench/remote_host.py --executor-sms 0,16,32 --out remote_host.json
        # two GPUs (kind nvidia-h200-x2): a real sender model on cuda:0
    python bench/remote_host.py --one-gpu --executor-sms 0,8,16,24,32 --out remote_host.json
        # one GPU: the sender is emulated (below)

The host model (Llama-3-8B geometry, dummy weights, decode CUDA graphs) runs on the last GPU and also
hosts an in-process executor; a sender offloads a share of its decode rows there over the
GPU-signalled exchange (the engine's `GatedProgram`, on a high-priority stream, in a green context of
K SMs when capped). One host thread issues, per iteration, the sender's step (which rings the
executor's gated program) and the host model's step, so the GPU sees exactly the concurrent work of
serving both. The host model's step is timed with events on its own stream, alone and while the
executor is busy; the sender's step likewise on the sender's stream, which shows what the cap costs
the remote rows.

Two GPUs: the sender is a real model on cuda:0 (`--senders` bs:ctx:share, its local rows there).
One GPU (`--one-gpu`, the default with a single GPU): the sender's own work ran on another GPU and
costs the host's GPU nothing, so it is stood in for by a paced exchange on the same GPU: per layer it
posts the remote rows' q|k|v (random) and rings the doorbell, spins on one thread block for the
sender's own work of a layer (its local rows' attention and GEMMs: by default 300 us for bs 128 and
480 us for bs 256 at 2K with half the rows remote, about the 11.6 / 17.4 ms steps measured on two
H200s in docs/benchmarks.md), then waits for the executor's output. The
executor's work is the real one (its attention over the guest's KV, the same kernels and graphs);
the q|k|v and output copies are within the GPU instead of over NVLink.
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
from sglang_ext.engine import sm_partition
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


def spin_cycles_per_us(device: torch.device) -> float:
    """Clock cycles `torch.cuda._sleep` spins per microsecond on `device` (measured, not the data sheet's)."""
    with torch.cuda.device(device):
        torch.cuda._sleep(1000)  # load the kernel
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 20_000_000
        a.record()
        torch.cuda._sleep(n)
        b.record()
        b.synchronize()
    return n / (a.elapsed_time(b) * 1e3)


class PacedSender:
    """One GPU: a sender whose own work is a spin per layer (module docstring). Its rows' KV is random
    and loaded once; every step decodes the same position again."""

    def __init__(self, remote: PeerRemote, executor: AttentionExecutor, guest: str, n_remote: int, ctx: int,
                 kv_shape: tuple[int, ...], layer_us: float, cycles_per_us: float) -> None:
        self.remote, self.executor, self.guest = remote, executor, guest
        self.handles = list(range(1, n_remote + 1))
        self.pos = ctx - 1
        dev = executor.device
        kv = torch.randn((-(-ctx // PAGE), *kv_shape), dtype=remote.sender.shape.dtype, device=dev)
        for h in self.handles:
            remote.load(h, kv, self.pos)
        sh = remote.sender.shape
        self.q = torch.randn(n_remote, sh.hq, sh.d, dtype=sh.dtype, device=dev)
        self.k = torch.randn(n_remote, sh.hkv, sh.d, dtype=sh.dtype, device=dev)
        self.v = torch.randn(n_remote, sh.hkv, sh.d, dtype=sh.dtype, device=dev)
        self.layers = sh.layers
        self.cycles = int(layer_us * cycles_per_us)
        self.stream = torch.cuda.Stream(dev)
        # Load the step's kernels now, before any gated program is queued: a kernel's first launch may
        # load its module, which waits for the GPU to go idle, and here the GPU holds the executor's
        # program waiting for this sender's doorbells (a deadlock the real sender, on another GPU, or
        # its captured graph, avoids).
        with torch.cuda.stream(self.stream):
            n = n_remote
            torch.cat([self.q.reshape(n, -1), self.k.reshape(n, -1), self.v.reshape(n, -1)], dim=1,
                      out=remote.sender.send[:n])
            torch.cuda._sleep(1)
        self.stream.synchronize()

    def run(self) -> None:
        seqs = self.executor.guests[self.guest].seqs
        for h in self.handles:
            seqs[h].length = self.pos
        self.remote.begin_step(self.handles, [self.pos] * len(self.handles))
        with torch.cuda.stream(self.stream):
            for layer in range(self.layers):
                self.remote.post(layer, self.q, self.k, self.v)
                torch.cuda._sleep(self.cycles)
                self.remote.collect(layer)


class Timed:
    """Runs `step` on `stream` and keeps the GPU time of each run (events on that stream)."""

    def __init__(self, step: Any, stream: Any) -> None:
        self.step, self.stream = step, stream
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __call__(self) -> None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(self.stream)
        self.step()
        b.record(self.stream)
        self.pending.append((a, b))

    def median_ms(self, skip: int = 3) -> float:
        torch.cuda.synchronize()
        ts = sorted(a.elapsed_time(b) for a, b in self.pending[skip:])
        self.pending.clear()
        return ts[len(ts) // 2]


def _host_step_ms(host: ModelRunner, batch: ForwardBatch, iters: int, also: Any = None) -> float:
    """Median over iterations of the host model's step on its own stream, with `also()` (the sender's
    step, which rings the executor's program) issued just before it each iteration."""
    dev = host.device
    step = Timed(lambda: host.forward(batch), torch.cuda.current_stream(dev))
    for _ in range(iters + 3):
        if also is not None:
            also()
        with torch.cuda.device(dev):
            step()
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)
    return step.median_ms()


def _sender_alone_ms(sender: Timed, iters: int) -> float:
    for _ in range(iters + 3):
        sender()
        torch.cuda.synchronize()
    return sender.median_ms()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="preset:llama-3-8b")
    p.add_argument("--host", default="64:2048", help="host model's own batch, bs:ctx")
    p.add_argument("--senders", default="128:2048:0.5:300,256:2048:0.5:480",
                   help="sender loads bs:ctx:share[:us] (the share's rows attend on the host's GPU; us: one GPU, "
                        "the emulated sender's own work per layer, default --sender-layer-us)")
    p.add_argument("--executor-sms", default="0",
                   help="caps on the executor's SMs to compare, comma-separated (executor_max_sms; 0: uncapped)")
    p.add_argument("--one-gpu", action="store_true", help="host, executor and a paced sender on cuda:0 "
                   "(the default when only one GPU is visible)")
    p.add_argument("--sender-layer-us", type=float, default=300.0,
                   help="one GPU: the emulated sender's own work per layer, microseconds, where --senders gives none")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="remote_host.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    one_gpu = a.one_gpu or torch.cuda.device_count() < 2
    hbs, hctx = (int(x) for x in a.host.split(":"))
    senders = [(int(f[0]), int(f[1]), float(f[2]), float(f[3]) if len(f) > 3 else a.sender_layer_us)
               for f in (x.split(":") for x in a.senders.split(","))]
    caps = [int(x) for x in a.executor_sms.split(",")]
    max_local = max(round(b * (1 - s)) * c for b, c, s, _ in senders)
    max_remote = max(round(b * s) * c for b, c, s, _ in senders)
    host_dev = "cuda:0" if one_gpu else "cuda:1"
    host = _runner(a.model_path, host_dev, hbs * hctx + 4 * PAGE)
    sender = None if one_gpu else _runner(a.model_path, "cuda:0", max_local + 4 * PAGE)
    model = sender or host
    cfg = model.cfg
    kv_token = model.pool.geometry.page_bytes // PAGE
    executor = AttentionExecutor(ForeignKVPartition(int(max_remote * kv_token * 1.1) + 2**30, host_dev),
                                 "flashinfer")
    host_batch = ForwardBatch.build(
        [BatchRow(hctx - 1, [7], pg, [0]) for pg in Layout(host.num_pages).pages(hbs, hctx)],
        ForwardMode.DECODE, PAGE, host_dev)
    cycles = spin_cycles_per_us(host.device) if one_gpu else 0.0
    res: dict[str, Any] = {"env": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                   "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                                   "torch": torch.__version__, "model": a.model_path, "host": a.host,
                                   "sender": "paced, one GPU" if one_gpu else "model on cuda:0",
                                   "spin_cycles_per_us": cycles or None},
                           "rows": []}
    alone = _host_step_ms(host, host_batch, a.iters)
    res["host_alone_ms"] = alone
    print(json.dumps({"host_alone_ms": alone}), flush=True)
    layout = Layout(sender.num_pages) if sender is not None else None
    for cap in caps:
        got = sm_partition.cap_executor(host.device, cap)  # programs made from here on run in it
        for bs, ctx, share, layer_us in senders:
            guest = f"bench-{cap}-{bs}"
            row: dict[str, Any] = {"executor_sms": got, "bs": bs, "ctx": ctx, "share": share,
                                   "sender_layer_us": layer_us if one_gpu else None}
            n_remote = round(bs * share)
            try:
                remote = PeerRemote(executor, guest, guest_spec(model), model.device, cfg.num_heads, max_rows=256)
                step: Any
                if sender is None:
                    step = PacedSender(remote, executor, guest, n_remote, ctx, tuple(host.pool.data.shape[1:]),
                                       layer_us, cycles)
                    timed = Timed(step.run, step.stream)
                else:
                    sender.set_remote(remote)
                    assert layout is not None
                    step = SplitStep(sender, remote, executor, guest, layout.pages(bs - n_remote, ctx), n_remote, ctx)
                    timed = Timed(step.run, torch.cuda.current_stream(sender.device))
                print(f"cap {cap}, bs {bs}: sender alone", flush=True)
                row["sender_alone_ms"] = _sender_alone_ms(timed, a.iters)
                print(f"cap {cap}, bs {bs}: host busy", flush=True)
                busy = _host_step_ms(host, host_batch, a.iters, timed)
                row.update(host_busy_ms=busy, increase=busy / alone - 1, sender_busy_ms=timed.median_ms())
            except Exception as e:  # record and go on
                row["error"] = f"{type(e).__name__}: {e}"
            executor.release_all(guest)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            Path(a.out).write_text(json.dumps(res, indent=1))
    sm_partition.cap_executor(host.device, 0)
    how = "paced on this GPU (its own work: sender_layer_us per layer)" if one_gpu else "a model on cuda:0"
    print(f"host alone {alone:.2f} ms; sender {how}")
    print(f"{'SMs':>4s} {'bs':>4s} {'remote':>6s} {'host busy':>9s} {'increase':>8s} {'sender alone':>12s} "
          f"{'sender busy':>11s}")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['executor_sms']:>4d} {r['bs']:>4d} error: {r['error']}")
            continue
        print(f"{r['executor_sms'] or 'all':>4} {r['bs']:>4d} {round(r['bs'] * r['share']):>6d} "
              f"{r['host_busy_ms']:>8.2f}  {100 * r['increase']:>+7.1f}% {r['sender_alone_ms']:>11.2f}  "
              f"{r['sender_busy_ms']:>10.2f}")


if __name__ == "__main__":
    main()
