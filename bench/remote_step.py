"""Sender decode step time with a share of the rows' attention on an idle peer GPU.

    python bench/remote_step.py --out remote_step.json      # needs two GPUs (kind nvidia-h200-x2)
    python bench/remote_step.py --executor-device cuda:0 --executor-gb 7 ...   # one GPU: the executor
        # in-process on the sender's own GPU (`--offload-executor local`, as the adaptive/fixed/off runs
        # of docs/benchmarks.md use it), its partition a fixed size
    python bench/remote_step.py --transport cuda_ipc --executor-load decode ...   # the executor's GPU busy
    python bench/remote_step.py ... --executor-load decode --load-confine green --load-free-sms 16
        # the busy GPU's load kept off 16 SMs (a green context, as --executor-reserved-sms partitions a
        # worker; `carveout`: cuBLASLt's SM count target)

Llama-3-8B geometry with dummy weights on cuda:0; an in-process attention executor (the engine's
`offload_executor="cuda:1"` path, FlashInfer on cuda:1) holds the remote rows' KV; `--transport` picks
torch cross-device copies per layer (`local`) or the GPU-signalled peer exchange (`cuda_ipc`).
For each (bs, ctx, offloaded share) the step is timed with CUDA events over
back-to-back forwards, with decode CUDA graphs (what serving uses; split batches have their 2-D
graphs only with the GPU-signalled transport) and eager. KV is random data laid out on scattered
pages, as in bench/offline.py.
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

from bench.gpu_measure import PAGE, Layout, SplitStep, time_gpu
from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.resolve import resolve_model_path
from sglang_ext.offload.executor import AttentionExecutor
from sglang_ext.offload.partition import ForeignKVPartition
from sglang_ext.offload.remote import LocalRemote
from sglang_ext.offload.setup import guest_spec
from sglang_ext.server_args import ServerArgs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="preset:llama-3-8b")
    p.add_argument("--points", default="64:2048,128:2048,256:2048,64:8192,128:8192",
                   help="bs:ctx pairs (bs 256 at ctx 8K needs 256 GiB of KV: more than two H200s hold)")
    p.add_argument("--shares", default="0,0.25,0.5,0.75")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--transport", default="local", choices=["local", "cuda_ipc"],
                   help="local: torch cross-device copies; cuda_ipc: GPU-signalled peer exchange")
    p.add_argument("--modes", default="graph,eager", help="graph (decode CUDA graphs), eager, or both")
    p.add_argument("--executor-load", default="off", choices=["off", "decode"],
                   help="decode: while timing, a thread keeps cuda:1 busy replaying a decode-like CUDA graph (32 "
                        "layers of small-batch GEMMs over 8B-sized weights), as a served cold model does to the "
                        "GPU that hosts the executor")
    p.add_argument("--load-confine", default="none", choices=["none", "carveout", "green"],
                   help="keep the load off --load-free-sms SMs: carveout (torch's cuBLASLt SM count target) "
                        "or green (a stream of a CUDA green context with the other SMs: the partition "
                        "a worker makes with --executor-reserved-sms)")
    p.add_argument("--load-free-sms", type=int, default=16)
    p.add_argument("--executor-device", default="cuda:1",
                   help="the executor's GPU: cuda:1 (another GPU), or cuda:0 (the sender's own, in-process)")
    p.add_argument("--executor-gb", type=float, default=None,
                   help="the executor's KV partition (default: what is free on its GPU less 8 GiB; on the "
                        "sender's own GPU it must be given)")
    p.add_argument("--out", default="remote_step.json")
    a = p.parse_args()
    exec_dev = torch.device(a.executor_device)
    if exec_dev.type != "cuda":
        raise SystemExit(f"--executor-device must be a GPU (cuda:0 or cuda:1), not {a.executor_device!r}")
    same_gpu = exec_dev.index in (None, 0)
    if same_gpu and (a.executor_gb is None or a.executor_load != "off" or a.transport != "local"):
        raise SystemExit("--executor-device cuda:0 needs --executor-gb, --executor-load off, --transport local")
    if torch.cuda.device_count() < (1 if same_gpu else 2):
        raise SystemExit("needs a GPU" if same_gpu else "needs two GPUs (or --executor-device cuda:0 on one)")
    exec_dev = torch.device("cuda", 0 if same_gpu else exec_dev.index)
    reserve = int(a.executor_gb * 2**30) if same_gpu else 0
    points = [tuple(int(x) for x in pt.split(":")) for pt in a.points.split(",")]
    shares = [float(x) for x in a.shares.split(",")]
    max_tokens = max(bs * ctx for bs, ctx in points)
    model_dir = resolve_model_path(a.model_path)
    cfg = ModelConfig.from_path(model_dir)
    free0 = torch.cuda.mem_get_info(0)[0]
    kv_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    local_tokens = min(max_tokens, int((free0 - 24 * 2**30 - reserve) // kv_token))  # weights + workspace headroom
    args = ServerArgs(model_path=a.model_path, load_format="dummy", device="cuda:0", dtype="bfloat16",
                      page_size=PAGE, max_total_tokens=local_tokens, cuda_graph_max_bs=256,
                      skip_tokenizer_init=True)
    runner = ModelRunner(args, model_dir, cfg)
    runner.pool.data.normal_()
    # Made before the executor's partition takes what is left of the executor's GPU.
    load = None
    if a.executor_load == "decode":
        load = ExecutorGpuLoad(exec_dev, cfg.hidden_size, cfg.num_layers,
                               confine=a.load_confine, free_sms=a.load_free_sms)
    if same_gpu:
        part_bytes = reserve  # set aside before the runner took its pool
    elif a.executor_gb is not None:
        part_bytes = int(a.executor_gb * 2**30)
    else:
        part_bytes = int(torch.cuda.mem_get_info(exec_dev)[0] - 8 * 2**30)
    executor = AttentionExecutor(ForeignKVPartition(part_bytes, str(exec_dev)), "flashinfer")
    remote: Any
    if a.transport == "local":
        remote = LocalRemote(executor, "bench", guest_spec(runner), executor_id=str(exec_dev))
    else:
        from sglang_ext.offload.peer import PeerRemote

        remote = PeerRemote(executor, "bench", guest_spec(runner), runner.device, cfg.num_heads, max_rows=256)
    runner.set_remote(remote)
    layout = Layout(runner.num_pages)
    if load is not None:
        load.start()
    res: dict[str, Any] = {"env": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                   "gpus": [torch.cuda.get_device_name(i) for i in range(1 if same_gpu else 2)],
                                   "executor_device": str(exec_dev), "executor_gb": round(part_bytes / 2**30, 2),
                                   "torch": torch.__version__, "model": a.model_path,
                                   "transport": a.transport, "executor_load": a.executor_load,
                                   "load_confine": a.load_confine if load else "none",
                                   "load_free_sms": a.load_free_sms if load and a.load_confine != "none" else 0},
           "rows": []}
    for bs, ctx in points:
        for share in shares:
            n_remote = round(bs * share)
            n_local = bs - n_remote
            row: dict[str, Any] = {"bs": bs, "ctx": ctx, "share": share, "remote_rows": n_remote}
            try:
                if n_local * ctx > local_tokens:
                    raise RuntimeError(f"{n_local} local rows x {ctx} exceed the sender's pool")
                pages = layout.pages(n_local, ctx) if n_local else []
                step = SplitStep(runner, remote, executor, "bench", pages, n_remote, ctx).run
                torch.cuda.synchronize(exec_dev)
                split_graphs = runner.graphs is not None and runner.graphs.split is not None
                if "graph" in a.modes and (n_remote == 0 or split_graphs):
                    row["graph_ms"] = time_gpu(step, a.steps)
                if "eager" in a.modes:
                    graphs, runner.graphs = runner.graphs, None
                    row["eager_ms"] = time_gpu(step, a.steps)
                    runner.graphs = graphs
                executor.release_all("bench")
            except Exception as e:  # record and go on: one infeasible point must not lose the rest
                row["error"] = f"{type(e).__name__}: {e}"
                executor.release_all("bench")
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            Path(a.out).write_text(json.dumps(res, indent=1))
    if load is not None:
        steps, secs = load.stop()
        res["env"]["executor_load_steps"] = steps
        res["env"]["executor_load_step_ms"] = round(1e3 * secs / max(steps, 1), 3)
        print(json.dumps({"executor_load_step_ms": res["env"]["executor_load_step_ms"]}), flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


class ExecutorGpuLoad:
    """A cold model's decode steps on the executor's GPU, without a model: one CUDA graph of `layers`
    x (qkv, o, gate|up, down) GEMMs at batch 4 over dummy bf16 weights about an 8B model's shapes
    (~15.6 GB streamed per step), replayed back to back by a thread on a stream of its own.

    `confine` keeps the load off `free_sms` SMs, so that the executor's kernels find SMs free at once
    instead of waiting for the load's blocks to retire: `carveout` captures the GEMMs with cuBLASLt's SM
    count target lowered (a hint the kernel choice follows), `green` captures and replays them in a
    CUDA green context that holds only the other SMs (a hard partition)."""

    def __init__(self, device: torch.device, hidden: int, layers: int, batch: int = 4,
                 confine: str = "none", free_sms: int = 16) -> None:
        import threading

        self.device, self.confine, self.free_sms = device, confine, free_sms
        shapes = [(hidden, 3 * hidden), (hidden, hidden), (hidden, 7 * hidden), (7 * hidden // 2, hidden)]
        with torch.cuda.device(device):
            self._ws = [[torch.randn(k, n, dtype=torch.bfloat16, device=device) * 0.01 for k, n in shapes]
                        for _ in range(layers)]
            self._x = torch.randn(batch, hidden, dtype=torch.bfloat16, device=device)
        self.steps = 0
        self.error: str | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._go = threading.Event()
        self._span = (0.0, 0.0)
        # Captured and replayed by the thread, which owns the load's stream.
        self._thread = threading.Thread(target=self._run, name="executor-gpu-load", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.error:
            raise RuntimeError(f"executor load ({confine}): {self.error}")

    @staticmethod
    def _step(x: torch.Tensor, ws: list[list[torch.Tensor]]) -> None:
        for qkv, o, up, down in ws:
            h = torch.mm(x, qkv)[:, : x.shape[1]]
            h = torch.mm(h, o)
            g = torch.mm(h, up)[:, : down.shape[0]]
            x.add_(torch.mm(g, down), alpha=1e-3)

    def _capture(self) -> tuple[torch.cuda.CUDAGraph, torch.cuda.Stream]:
        torch.cuda.set_device(self.device)
        if self.confine == "green":
            # The worker's partition (sglang_ext/engine/sm_partition.py): a stream of a green context that
            # holds all SMs but free_sms; the executor's streams stay in the primary context.
            from sglang_ext.engine import sm_partition

            stream = sm_partition.make(self.device, self.free_sms)
        else:
            stream = torch.cuda.Stream(self.device)
        lib = torch.backends.cuda.preferred_blas_library()
        if self.confine == "carveout":  # honoured by the cuBLASLt path; set only while this graph is captured
            torch.backends.cuda.preferred_blas_library("cublaslt")
            torch._C._set_sm_carveout_experimental(self.free_sms)
        try:
            with torch.cuda.stream(stream):
                self._step(self._x, self._ws)  # cuBLAS handles and workspaces before the capture
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    self._step(self._x, self._ws)
        finally:
            if self.confine == "carveout":
                torch._C._set_sm_carveout_experimental(None)
                torch.backends.cuda.preferred_blas_library(lib)
        return graph, stream

    def _run(self) -> None:
        import time

        try:
            graph, stream = self._capture()
        except Exception as e:  # reported by the constructor
            self.error = f"{type(e).__name__}: {e}"
            self._ready.set()
            return
        self._ready.set()
        self._go.wait()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            while not self._stop.is_set():
                graph.replay()
                self.steps += 1
                if self.steps % 4 == 0:
                    stream.synchronize()  # keep a few steps queued, not thousands
            stream.synchronize()
        self._span = (t0, time.perf_counter())

    def start(self) -> None:
        self._go.set()

    def stop(self) -> tuple[int, float]:
        """Steps replayed and the seconds they took."""
        self._stop.set()
        self._go.set()
        self._thread.join()
        return self.steps, self._span[1] - self._span[0]


if __name__ == "__main__":
    main()
