"""One simulated model instance: the real Scheduler on its own synthetic clock, on a simulated GPU.

bench/policy_sim.py drives one Scheduler alone; a fleet needs several on shared GPUs, each able to
offload attention to another GPU (WEAVER) or rotate KV to host memory. This builds the scheduler the
same way (a tiny Llama whose pool has the modelled model's token capacity), but its forward never
runs the tiny model: the scheduler's decisions (admission, preemption, rotation, offload) read only
lengths and page ownership, every request ignores EOS, so the logits carry nothing the simulation
needs and a zero tensor of the right shape stands in (the policy_sim equivalence test checks that).

Time: a forward starts when the instance's clock, its rotation copies and its GPU are all ready
(instances sharing a GPU time-slice it: one forward at a time, no overlap between processes), and
lasts what the CostModel says for the modelled geometry:

- local rows: `CostModel.prefill_s` (decode rows and prefill chunks of one batch);
- remote rows (WEAVER): their dense work stays here, their KV read moves to the executor's GPU, and
  each step pays `CostModel.exchange_s`; the executor's attention is hidden unless it is the longer
  part (then the step waits for it); a request's KV copied to the executor costs its bytes at
  `peer_GBps` on the sender's next step;
- on a GPU that hosts guests' KV, every forward of its own models is `1 + host_increase` longer
  (`CostModel.host_increase` by the guest KV GiB held now, or flat by the executor's SM cap).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch

from bench.policy_sim import VOCAB, Clock, TimedEngine, tiny_model
from bench.sim.cost import CALIBRATION_DIR, Calibration, CostModel, GiB
from bench.sim.geometry import Geometry
from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.forward_batch import ForwardBatch
from sglang_ext.offload.setup import local_sender
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler
from sglang_ext.server_args import ServerArgs

# GPU memory as the driver reports it (nvidia-smi's total, in GiB) per calibrated GPU type. A GPU type
# is known when it has a calibration file and a row here.
# h100's file is derived from the h200's by datasheet ratios (bench/sim/derive.py), not profiled.
GPU_MEMORY_GIB: Final = {"h200": 143_771 / 1024, "h100": 81_559 / 1024}
PROCESS_OVERHEAD_GIB: Final = 1.75  # CUDA context + activations per instance: a 0.25 share of an H200
# with Llama-3-8B (13.98 GiB of weights) gives the measured 158,656-token pool (docs/benchmarks.md)
PEER_GBPS: Final = 390.0  # GPU-to-GPU KV copies (docs/remote_attention.md's figure; not in the calibration)
H200_SMS: Final = 132


def known_gpus() -> list[str]:
    """GPU types with a calibration file and a known memory size."""
    files = {p.stem for p in CALIBRATION_DIR.glob("*.json") if not p.stem.endswith("-validation")}
    return sorted(files & set(GPU_MEMORY_GIB))


def gpu_calibration(gpu: str) -> tuple[Path, float]:
    """(calibration file, memory GiB) of a GPU type; an unknown one is a ValueError naming the known."""
    key = gpu.lower()
    if key not in known_gpus():
        raise ValueError(f"unknown GPU {gpu!r}: the simulator knows {', '.join(known_gpus())} "
                         f"(a GPU needs a calibration file in {CALIBRATION_DIR}, written by python -m bench.sim.fit)")
    return CALIBRATION_DIR / f"{key}.json", GPU_MEMORY_GIB[key]


def with_link(cal: Calibration, per_direction_GBps: float) -> Calibration:
    """The same calibration with only the host link changed (an assumption, e.g. GH200's C2C): both
    directions at `per_direction_GBps`, and both at once at twice that."""
    raw = json.loads(json.dumps(cal.raw))
    raw["host_link"] = {**raw["host_link"], "d2h_GBps": per_direction_GBps, "h2d_GBps": per_direction_GBps,
                        "duplex_GBps": 2 * per_direction_GBps}
    raw["gpu"] = f"{cal.gpu} with an assumed {per_direction_GBps:g} GB/s host link"
    return Calibration.from_dict(raw)


def pool_tokens_for(geo: Geometry, mem_fraction: float, gpu_mem_gib: float, minus_gib: float = 0.0) -> int:
    """KV tokens an instance gets from `mem_fraction` of a GPU: that share, less its weights, the
    process overhead and `minus_gib` (memory it lends an executor)."""
    free = mem_fraction * gpu_mem_gib - geo.dense_weight_bytes / GiB - PROCESS_OVERHEAD_GIB - minus_gib
    if geo.is_moe:
        free -= geo.sparse_layers * geo.num_experts * geo.expert_bytes / GiB
    if free <= 0:
        raise ValueError(f"{geo.name}: its weights do not fit in {mem_fraction:.3g} of a {gpu_mem_gib:.0f} GiB GPU "
                         f"(with {minus_gib:.1f} GiB lent to an executor)")
    return int(free * GiB / geo.kv_bytes_per_token)


@dataclass
class SimGpu:
    """A simulated GPU: one forward at a time, and the guests' KV it holds for executors."""

    index: int
    free_at: float = 0.0
    executor_sms: int | None = None  # the executor's SM cap on this GPU (None: uncapped)
    senders: list[Instance] = field(default_factory=list)  # instances whose executor lives here
    busy_s: float = 0.0

    def guest_gib(self) -> float:
        return sum(s.remote_kv_tokens() * s.cost.kv_bytes_per_token for s in self.senders) / GiB

    def slowdown(self, cost: CostModel) -> float:
        """Fraction by which this GPU's own forwards are longer while it hosts guests now."""
        gib = self.guest_gib()
        if gib <= 0:
            return 0.0
        return cost.host_increase(gib, self.executor_sms)


@dataclass
class InstanceSpec:
    """One model instance: which model, where, and how it schedules."""

    name: str  # unique in the fleet
    model: str  # the model it serves (instances of one model are its replicas)
    pool_tokens: int
    ttft_s: float
    tpot_s: float
    policy: str = "fcfs"
    mode: str = "recompute"  # or "rotate"
    host_gb: float = 0.0  # host KV pool for rotation, in the modelled model's bytes
    offload_ratio: float = 0.0  # WEAVER: share of decoding requests attended on the executor
    executor_tokens: int = 0  # the executor's room for this instance's KV (modelled tokens)
    exchange_variant: str = "lean"
    page_size: int = 16
    context: int = 32_768
    chunked_prefill: int = 8192
    decode_only: bool = False  # a PD decode worker: a request's prompt KV arrives by transfer, its prefill is free


class Instance:
    """The real Scheduler of one instance, its clock and its requests."""

    def __init__(self, spec: InstanceSpec, cost: CostModel, gpu: SimGpu, executor_gpu: SimGpu | None = None,
                 peer_GBps: float = PEER_GBPS) -> None:
        self.spec, self.cost, self.gpu, self.executor_gpu, self.peer_GBps = spec, cost, gpu, executor_gpu, peer_GBps
        self.clock = Clock()
        self.todo: list[Req] = []
        self.arrival: dict[str, float] = {}
        self.out_len: dict[str, int] = {}
        self.times: dict[str, list[float]] = {}
        self.failed: dict[str, str] = {}
        self.finished: list[str] = []  # request ids in the order they finished here
        self.steps = 0
        self.remote_row_steps = 0  # remote rows summed over steps
        self.remote_steps = 0  # steps with at least one remote row
        self.busy_s = 0.0
        self.exchange_s = 0.0
        self.slowed_s = 0.0  # time its forwards lost to guests on its GPU
        self._pending_load_s = 0.0
        self.s = self._build()
        if executor_gpu is not None and self.remote_sender is not None:
            executor_gpu.senders.append(self)

    # -- construction ----------------------------------------------------------------------------
    def _build(self) -> Scheduler:
        sp, cost = self.spec, self.cost
        cfg = tiny_model(sp.context)
        tiny_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32 K and V
        extra: dict[str, Any] = {}
        if sp.mode == "rotate":
            host_tokens = int(sp.host_gb * GiB / cost.kv_bytes_per_token)
            extra.update(kv_host_size_gb=host_tokens * tiny_bytes / GiB,
                         rotation_budget_mb=256 * tiny_bytes / cost.kv_bytes_per_token)
        if sp.offload_ratio > 0:
            if self.executor_gpu is None or sp.executor_tokens <= 0:
                raise ValueError(f"{sp.name}: offload_ratio needs an executor GPU and executor_tokens > 0")
            extra.update(offload_executor="local", offload_ratio=sp.offload_ratio,
                         executor_mem_gb=sp.executor_tokens * tiny_bytes / GiB)
        sa = ServerArgs(device="cpu", dtype="float32", load_format="dummy", page_size=sp.page_size,
                        max_total_tokens=sp.pool_tokens, schedule_policy=sp.policy,  # type: ignore[arg-type]
                        preemption_mode=sp.mode,  # type: ignore[arg-type]
                        chunked_prefill_size=sp.chunked_prefill, ttft_slo_ms=sp.ttft_s * 1e3,
                        tpot_slo_ms=sp.tpot_s * 1e3, **extra)
        runner = ModelRunner(sa, None, cfg)  # type: ignore[arg-type]
        remote_sender = local_sender(sa, runner, sp.name)
        s = Scheduler(sa, runner, sp.page_size, frozenset(), vocab_size=VOCAB, remote_sender=remote_sender)
        s.clock = self.clock
        if s.rot is not None:
            s.rot.engine = TimedEngine(s.rot.engine, self.clock, cost, sp.page_size)
        if remote_sender is not None:
            load = remote_sender.remote.load

            def timed_load(handle: int, kv: torch.Tensor, length: int, reserve_tokens: int = 0) -> bool:
                ok = load(handle, kv, length, reserve_tokens)
                if ok:  # the copy to the executor's GPU delays the sender's next forward
                    self._pending_load_s += length * cost.kv_bytes_per_token / (self.peer_GBps * 1e9)
                return ok

            remote_sender.remote.load = timed_load  # type: ignore[method-assign]
        runner.forward = self._forward  # type: ignore[method-assign]
        return s

    @property
    def remote_sender(self) -> Any:
        return self.s.remote_sender if hasattr(self, "s") else None

    def remote_kv_tokens(self) -> int:
        off = self.s.remote_sender
        return sum(r.kv_len for r in off.reqs.values()) if off is not None else 0

    # -- time ------------------------------------------------------------------------------------
    def forward_cost(self, batch: ForwardBatch) -> tuple[float, float]:
        """(seconds on this GPU before the host slowdown, of which exchange) of one scheduler batch."""
        cost = self.cost
        rows = kv = 0
        chunks: list[tuple[int, int]] = []
        for n, end in zip(batch.extend_lens, batch.seq_lens, strict=True):
            if n == 1:
                rows, kv = rows + 1, kv + end
            elif not self.spec.decode_only:
                chunks.append((n, end))
        remote = len(batch.split.remote_handles) if batch.split is not None else 0
        t = cost.prefill_s(chunks, rows + remote, kv)
        if not remote:
            return t, 0.0
        assert batch.split is not None
        remote_kv = sum(p + 1 for p in batch.split.remote_positions)
        sms = self.executor_gpu.executor_sms if self.executor_gpu is not None else None
        share = min(1.0, sms / H200_SMS) if sms else 1.0  # capped executor: bandwidth in proportion (assumed)
        attend = remote_kv * cost.kv_bytes_per_token / (cost.cal.get("decode", "kv_GBps") * 1e9 * share)
        ex = cost.exchange_s(remote, self.spec.exchange_variant)
        return max(t, attend) + ex, ex

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        clock, gpu = self.clock, self.gpu
        start = max(clock.t, clock.stall, gpu.free_at)
        base, ex = self.forward_cost(batch)
        slow = gpu.slowdown(self.cost) if gpu.senders else 0.0
        dur = base * (1.0 + slow) + self._pending_load_s
        self._pending_load_s = 0.0
        clock.t = start + dur
        gpu.free_at = clock.t
        gpu.busy_s += dur
        self.busy_s += dur
        self.exchange_s += ex
        self.slowed_s += base * slow
        self.steps += 1
        if batch.split is not None:
            self.remote_row_steps += len(batch.split.remote_handles)
            self.remote_steps += 1
        return torch.zeros(int(batch.logits_indices.shape[0]), VOCAB)

    # -- requests --------------------------------------------------------------------------------
    def add(self, rid: str, arrival: float, prompt: list[int], out_len: int) -> None:
        """A request this instance receives at `arrival` (kept in arrival order; one added behind this
        instance's clock is delivered at its next iteration)."""
        req = Req(rid, prompt, SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True),
                  arrival_time=arrival)
        bisect.insort(self.todo, req, key=lambda r: r.arrival_time)
        self.arrival[rid] = arrival
        self.out_len[rid] = out_len
        self.times[rid] = []

    def next_time(self, horizon_s: float) -> float:
        """When this instance acts next (inf: it is done, or past the horizon)."""
        if self.clock.t >= horizon_s:
            return float("inf")
        if self.s.has_work():
            return max(self.clock.t, self.gpu.free_at)  # a shared GPU: its turn comes when the GPU is free
        return self.todo[0].arrival_time if self.todo else float("inf")

    def advance(self) -> None:
        """One scheduler iteration (as policy_sim's replay loop): deliver what has arrived, then step."""
        clock = self.clock
        clock.t = max(clock.t, self.gpu.free_at) if self.s.has_work() else clock.t
        while self.todo and self.todo[0].arrival_time <= clock.t:
            r = self.todo.pop(0)
            try:
                self.s.add_request(r)
            except Exception as e:  # a request the engine refuses (too long for the pool or context)
                self.failed[r.rid] = f"refused: {e}"
        if not self.s.has_work():
            if self.todo:
                clock.t = max(clock.t, self.todo[0].arrival_time)
            return
        before = clock.t
        for o in self.s.step():
            self.times[o.rid].extend([clock.t] * len(o.new_token_ids))
            if o.finished:
                self.finished.append(o.rid)
            if o.finished and o.finish_reason and o.finish_reason.get("type") == "abort":
                self.failed[o.rid] = str(o.finish_reason.get("message", "aborted"))
        if clock.t == before:
            clock.t = max(clock.t + 1e-3, clock.stall)  # no forward (copies landing): time still passes

    def result(self) -> dict[str, Any]:
        """policy_sim.replay's result form (arrival, token times of requests with any token)."""
        done = {rid: ts for rid, ts in self.times.items() if ts}
        return {"arrival": dict(self.arrival), "times": done,
                "rotations": self.s.rot.rotations_out if self.s.rot is not None else 0,
                "preemptions": self.s.num_preemptions}


def run_instances(instances: list[Instance], horizon_s: float, on_step: Callable[[Instance], None] | None = None
                  ) -> int:
    """The event loop: always advance the instance that acts earliest, until every instance is done or
    past `horizon_s`. Ties (instances waiting for one GPU) go to the one whose clock is earliest, i.e.
    that has waited longest, then to list order. Returns the number of iterations."""
    n = 0
    while True:
        best: Instance | None = None
        when = (float("inf"), float("inf"))
        for inst in instances:
            key = (inst.next_time(horizon_s), inst.clock.t)
            if key[0] < float("inf") and key < when:
                best, when = inst, key
        if best is None:
            return n
        best.advance()
        n += 1
        if on_step is not None:
            on_step(best)
