"""Remote attention microbenchmarks. Section `exchange`: the per-layer exchange of a decode step
between a sender and an attention executor, signalled on the GPU vs driven by the CPU.

    python bench/remote_attention.py exchange --out ra_exchange.json   # nvidia-h200-x2: all rows
    python bench/remote_attention.py exchange --smoke                  # one batch size, 3 steps

Llama-3-8B geometry (32 layers, 32 q heads, 8 kv heads, head_dim 128, bf16). Per layer the sender pushes
q|k|v of `bs` rows (bs x 12 KiB) into the executor's buffer and rings doorbell[l]; the executor waits for
it, "computes" (copies the q part into its output: this section measures signalling and data movement,
not attention), pushes o (bs x 8 KiB) back and sets done[l]; the sender waits for done[l]. Rows, per bs:

- `data_only`: the same copies (and the compute copy) back to back with no signalling, each side timed
  on its own stream; their sum per layer is the floor the exchange cannot beat.
- `gpu_signalled`: the protocol with flags written and awaited by the GPUs (cuStreamWriteValue32 /
  cuStreamWaitValue32); `graph`: one CUDA graph per side per step, `eager`: the same ops issued by the
  host each step. Added latency = signalled graph - data_only graph. Each waiter zeroes each flag it
  consumed, after the wait.
- `gpu_signalled_lean` (two GPUs, graph): the same with each side's flags zeroed once per step, one memset
  after its last wait: the engine's scheme (sglang_ext/transport/gated.py); `added_lean_us` in the summary.
- `cpu_driven`: per layer the sender's host waits for its push (event synchronize), the executor's host
  launches compute + push and waits for it, then the sender goes on. In the two-GPU topology one thread
  drives both GPUs (no hand-off cost: a lower bound for a CPU-driven design); across processes each layer
  is also handed over a pipe and back.

Topologies: `two_gpu` (sender on GPU 0, executor on GPU 1, one process, peer access) and `two_process`
(both on GPU 0, the executor a child process, buffers shared with CUDA IPC). The targets: added
latency <= 15 us per layer, and gpu_signalled >= 4x faster than cpu_driven. Every cell guards itself
(its error is recorded and the run goes on); `--budget-s` bounds the whole section.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import ra_ipc
from bench.ra_exchange import (
    Buffers,
    Executor,
    Geometry,
    Remote,
    Sender,
    Stuck,
    capture,
    mark,
    replay,
    time_stream,
    unblock,
    wait_events,
)
from sglang_ext.transport import cuda_signal

TARGET_ADDED_US = 15.0
TARGET_SPEEDUP = 4.0
CELLS = (("data_only", "graph"), ("data_only", "eager"), ("gpu_signalled", "graph"), ("gpu_signalled", "eager"),
         ("gpu_signalled_lean", "graph"), ("cpu_driven", "host"))  # lean: flags reset once per step (two GPUs)


class Report:
    """Rows as they come, written to --out after each cell (a killed run keeps what it measured)."""

    def __init__(self, path: str, config: dict[str, Any]) -> None:
        self.path, self.t0 = path, time.monotonic()
        self.data: dict[str, Any] = {"env": env_info(), "config": config, "rows": [], "skipped": []}

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def skip(self, topology: str, reason: str) -> None:
        self.data["skipped"].append({"topology": topology, "reason": reason})
        print(f"{topology}: skipped: {reason}", flush=True)
        self.save()

    def add(self, row: dict[str, Any]) -> None:
        self.data["rows"].append(row)
        self.save()

    def save(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        self.data["summary"] = summarize(self.data["rows"])
        Path(self.path).write_text(json.dumps(self.data, indent=1))


def cell(report: Report, budget: float, topology: str, bs: int, variant: str, mode: str, layers: int,
         fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one measurement, guarded; returns its row (with "error" if it failed or was skipped)."""
    row: dict[str, Any] = {"topology": topology, "bs": bs, "variant": variant, "mode": mode}
    if report.elapsed() > budget:
        row["error"] = "skipped: time budget spent"
        report.add(row)
        return row
    try:
        res = fn()
        if variant == "data_only":
            send, exe = statistics.median(res["send_ms"]), statistics.median(res["exec_ms"])
            res.update(ms_per_step=[a + b for a, b in zip(res["send_ms"], res["exec_ms"], strict=True)],
                       send_us_per_layer=send * 1e3 / layers, exec_us_per_layer=exe * 1e3 / layers)
        row.update(res, us_per_layer=statistics.median(res["ms_per_step"]) * 1e3 / layers)
        print(f"{topology:11s} bs={bs:4d} {variant:13s} {mode:5s} {row['us_per_layer']:8.1f} us/layer"
              f"{'' if row.get('check', True) else '  CHECK FAILED'}", flush=True)
    except Stuck:
        raise
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc(limit=6)
        print(f"{topology:11s} bs={bs:4d} {variant:13s} {mode:5s} ERROR {row['error']}", flush=True)
    report.add(row)
    return row


# ---- two GPUs, one process ----------------------------------------------------------------------------
def two_gpu_signalled(snd: Sender, exe: Executor, bs: int, mode: str, a: argparse.Namespace,
                      lean: bool = False) -> dict[str, Any]:
    # Every cell starts from lowered flags (a cell that timed out may have left some raised, and a step
    # that found them raised would pass its waits early or ring doorbells still set).
    for flags, dev in ((snd.own.flags, 0), (exe.own.flags, 1)):
        s = torch.cuda.Stream(device=dev)
        flags.fill(s, 0)
        s.synchronize()
    if mode == "graph":
        gs = capture(snd.stream, lambda: snd.step(bs, lean))
        gx = capture(exe.stream, lambda: exe.step(bs, lean))
        enq_s, enq_x = (lambda: replay(gs, snd.stream)), (lambda: replay(gx, exe.stream))
    else:
        enq_s, enq_x = (lambda: snd.step(bs, lean)), (lambda: exe.step(bs, lean))
    rescue = [(exe.own.flags, torch.cuda.Stream(device=1)), (snd.own.flags, torch.cuda.Stream(device=0))]

    def run(n_warm: int, n_timed: int) -> float:
        # Executor's step i queued before the sender's: a host blocked on a full queue still sees progress.
        for _ in range(n_warm):
            enq_x()
            enq_s()
        e0 = mark(snd.stream)
        for _ in range(n_timed):
            enq_x()
            enq_s()
        e1, x1 = mark(snd.stream), mark(exe.stream)
        if not wait_events([e1, x1], a.timeout_s):
            unblock(rescue, [snd.stream, exe.stream])
            raise TimeoutError(f"exchange did not finish within {a.timeout_s} s (flags forced, streams drained)")
        return e0.elapsed_time(e1) / n_timed

    snd.refresh(bs, seed=bs)
    run(0, 1)
    zeros = [0] * snd.geo.layers  # both schemes leave every flag lowered between steps
    ok = snd.check(bs) and snd.own.flags.read() == zeros and exe.own.flags.read() == zeros
    return {"ms_per_step": [run(a.warmup, a.steps) for _ in range(a.repeats)], "check": ok}


def two_gpu_data(snd: Sender, exe: Executor, bs: int, mode: str, a: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for key, side in (("send_ms", snd), ("exec_ms", exe)):
        enqueue: Callable[[], None] = partial(side.data_only, bs)
        if mode == "graph":
            enqueue = partial(replay, capture(side.stream, enqueue), side.stream)
        out[key] = time_stream(enqueue, side.stream, a.steps, a.warmup, a.repeats)
    return out


def two_gpu_cpu(snd: Sender, exe: Executor, bs: int, a: argparse.Namespace) -> dict[str, Any]:
    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            for layer in range(snd.geo.layers):
                snd.cpu_push(layer, bs)
                exe.cpu_layer(layer, bs)
        return (time.perf_counter() - t0) * 1e3 / n

    snd.refresh(bs, seed=bs)
    run(1)
    ok = snd.check(bs)
    times = []
    for _ in range(a.repeats):
        run(a.warmup)
        times.append(run(a.steps))
    return {"ms_per_step": times, "check": ok}


def two_gpu(report: Report, geo: Geometry, a: argparse.Namespace) -> None:
    if torch.cuda.device_count() < 2:
        report.skip("two_gpu", f"needs 2 GPUs, {torch.cuda.device_count()} visible")
        return
    cuda_signal.enable_peer_access(0, 1)
    cuda_signal.enable_peer_access(1, 0)
    sbuf, xbuf = Buffers(geo, 0, seed=1), Buffers(geo, 1, seed=2)
    snd, exe = Sender(sbuf, xbuf.remote()), Executor(xbuf, sbuf.remote())
    broken = ""
    for bs in a.bs:
        for variant, mode in CELLS:
            if variant.startswith("gpu_signalled") and broken:
                report.add({"topology": "two_gpu", "bs": bs, "variant": variant, "mode": mode,
                            "error": f"skipped after an earlier failure: {broken}"})
                continue
            if variant == "data_only":
                fn = partial(two_gpu_data, snd, exe, bs, mode, a)
            elif variant.startswith("gpu_signalled"):
                fn = partial(two_gpu_signalled, snd, exe, bs, mode, a, lean=variant.endswith("_lean"))
            else:
                fn = partial(two_gpu_cpu, snd, exe, bs, a)
            row = cell(report, a.budget_s, "two_gpu", bs, variant, mode, geo.layers, fn)
            if variant.startswith("gpu_signalled") and "TimeoutError" in row.get("error", ""):
                broken = f"bs {bs} {mode} timed out"  # each later cell would cost another timeout


# ---- two processes, one GPU ---------------------------------------------------------------------------
def two_process(report: Report, geo: Geometry, a: argparse.Namespace) -> None:
    if a.budget_s - report.elapsed() < 30:
        report.skip("two_process", "time budget nearly spent (the child process needs ~20 s to start)")
        return
    exe = ra_ipc.ExecutorProcess(geo, 0, a.timeout_s)
    try:
        torch.cuda.set_device(0)
        sbuf = Buffers(geo, 0, seed=1)
        exe.attach(sbuf)
        peer, maps = Remote.open(exe.exported, 0, geo)
        snd = Sender(sbuf, peer)
        for bs in a.bs:
            for variant, mode in CELLS:
                if variant == "gpu_signalled_lean":
                    continue  # measured across two GPUs only
                runs = (a.steps, a.warmup, a.repeats)
                if variant == "data_only":
                    fn = partial(ra_ipc.data_only, snd, exe, bs, mode, *runs)
                elif variant == "gpu_signalled":
                    fn = partial(ra_ipc.signalled, snd, peer, exe, bs, mode, *runs, seed=bs)
                else:
                    fn = partial(ra_ipc.cpu_driven, snd, exe, bs, *runs, seed=bs)
                row = cell(report, a.budget_s, "two_process", bs, variant, mode, geo.layers, fn)
                if not row.get("error", "skipped").startswith("skipped"):
                    report.skip("two_process", f"stopped after the failed cell (bs {bs}, {variant} {mode}): "
                                "the executor process's state is unknown")
                    return
        for m in maps:
            m.close()
    finally:
        exe.close()


# ---- report -------------------------------------------------------------------------------------------
def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per topology and bs: the figures the targets are stated in."""
    table: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        if "us_per_layer" in r:
            key = f"{r['variant']}_{r['mode']}" if r["variant"] != "cpu_driven" else "cpu_driven"
            table.setdefault((r["topology"], r["bs"]), {})[key] = r["us_per_layer"]
    out = []
    for (topo, bs), t in table.items():
        s: dict[str, Any] = {"topology": topo, "bs": bs, **{k: round(v, 2) for k, v in t.items()}}
        sig, data, cpu = t.get("gpu_signalled_graph"), t.get("data_only_graph"), t.get("cpu_driven")
        if sig is not None and data is not None:
            s["added_us"] = round(sig - data, 2)
            s["meets_added"] = sig - data <= TARGET_ADDED_US
        lean = t.get("gpu_signalled_lean_graph")
        if lean is not None and data is not None:
            s["added_lean_us"] = round(lean - data, 2)
            s["meets_added_lean"] = lean - data <= TARGET_ADDED_US
        if sig is not None and cpu is not None:
            s["cpu_over_signalled"] = round(cpu / sig, 2)
            s["meets_speedup"] = cpu / sig >= TARGET_SPEEDUP
        out.append(s)
    return out


def print_table(summary: list[dict[str, Any]], geo: Geometry) -> None:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}"

    print(f"\nus per layer ({geo.layers} layers per step); added = signalled graph - data_only graph; "
          f"targets: added <= {TARGET_ADDED_US:g} us, cpu/signalled >= {TARGET_SPEEDUP:g}x")
    print(f"{'topology':11s} {'bs':>4s} {'in KiB':>7s} {'out KiB':>7s} {'data':>7s} {'data eg':>7s} "
          f"{'sig':>7s} {'sig eg':>7s} {'added':>7s} {'lean':>7s} {'added l':>7s} {'cpu':>7s} {'cpu/sig':>7s}  targets")
    for s in summary:
        met = [s.get("meets_added"), s.get("meets_speedup")]
        verdict = "-" if None in met else ("met" if all(met) else "MISSED")
        cols = ["data_only_graph", "data_only_eager", "gpu_signalled_graph", "gpu_signalled_eager", "added_us",
                "gpu_signalled_lean_graph", "added_lean_us", "cpu_driven", "cpu_over_signalled"]
        kib = f"{geo.in_bytes(s['bs']) / 1024:7.0f} {geo.out_bytes(s['bs']) / 1024:7.0f}"
        cells = " ".join(f"{f(s.get(c)):>7s}" for c in cols)
        print(f"{s['topology']:11s} {s['bs']:4d} {kib} {cells}  {verdict}")


def env_info() -> dict[str, Any]:
    info: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                            "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
                            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    try:
        d = cuda_signal.driver()
        info["cuda_python_module"] = d.__name__
        info["driver_version"] = int(d.cuDriverGetVersion()[1])
        attr = d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES
        info["can_flush_remote_writes"] = int(d.cuDeviceGetAttribute(attr, d.cuDeviceGet(0)[1])[1])
        if torch.cuda.device_count() > 1:
            info["peer_access_0_1"] = torch.cuda.can_device_access_peer(0, 1)
    except Exception as e:  # the report still says what failed
        info["cuda_python_error"] = f"{type(e).__name__}: {e}"
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("section", nargs="?", default="exchange", choices=["exchange"])
    p.add_argument("--bs", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64, 128, 256],
                   help="batch sizes (rows offloaded per step)")
    p.add_argument("--topologies", default="two_gpu,two_process")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per repeat")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each repeat")
    p.add_argument("--repeats", type=int, default=5, help="repeats per cell (the median is reported)")
    p.add_argument("--budget-s", type=float, default=200.0, help="cells after this many seconds are skipped")
    p.add_argument("--timeout-s", type=float, default=5.0, help="a run of steps that takes longer is stuck")
    p.add_argument("--smoke", action="store_true", help="one batch size, 3 steps, 1 repeat")
    p.add_argument("--out", default="ra_exchange.json")
    a = p.parse_args()
    if a.smoke:
        a.bs, a.steps, a.warmup, a.repeats = [64], 3, 1, 1
    os.environ.update(ra_ipc.NO_MULTICAST)  # NVLink multicast stays off here and in the child
    geo = Geometry(max_bs=max(a.bs))
    report = Report(a.out, dict(vars(a)))
    try:
        cuda_signal.driver()
    except cuda_signal.CudaSignalError as e:
        report.skip("all", str(e))
        return
    runners = {"two_gpu": two_gpu, "two_process": two_process}
    try:
        for topo in a.topologies.split(","):
            try:
                runners[topo](report, geo, a)
            except Stuck:
                raise
            except Exception as e:
                report.skip(topo, f"{type(e).__name__}: {e}")
    except Stuck as e:
        report.skip("all", f"stopped: {e}")
        print_table(report.data["summary"], geo)
        os._exit(3)  # blocked GPU streams could hang the interpreter's CUDA teardown
    report.save()
    print_table(report.data["summary"], geo)
    print(f"\nwrote {a.out} ({report.elapsed():.0f} s)")


if __name__ == "__main__":
    main()
