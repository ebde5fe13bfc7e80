"""Prefill/decode disaggregation on two simulated GPUs, plain and with Adrenaline's placement.

A prefill instance (GPU 0) runs each request's prompt and its first token; the request then moves to a
decode instance (GPU 1) after its prompt KV crosses at `transfer_GBps`, and the decode instance prices no
prefill for it (its KV arrived; `InstanceSpec.decode_only`). Both are the real Scheduler. Adrenaline:
the decode instance keeps `offload_ratio` of its decoding requests' attention and KV on an executor on
the prefill GPU (the engine's offload path makes the choice), which lends `lend_gib` of its memory; the
prefill GPU's steps pay `host_increase` (by the executor's SM cap when one is given, as Adrenaline
reserves SMs for it), and the decode steps pay the exchange. In the engine a placed request's KV never
leaves the prefill GPU; here it is first handed to the decode instance like every request (its transfer
is charged) and then moved to the executor at no cost: a small overcharge on Adrenaline's side.

Limits: a request handed over while the decode instance's clock is already past its arrival is delivered
at that instance's next iteration (at most one step late); the PD KV-transfer rate is an assumption (no
measurement in the calibration).
"""

from __future__ import annotations

from typing import Any

from bench.policy_sim import summarize
from bench.sim.cost import Calibration, CostModel, GiB
from bench.sim.fleet import FULL, ModelSpec, load_geometry, make_requests
from bench.sim.instance import PEER_GBPS, Instance, InstanceSpec, SimGpu, pool_tokens_for, run_instances


def run_pd(m: ModelSpec, cal: Calibration, gpu_mem_gib: float, seconds: float, seed: int = 0,
           offload_ratio: float = 0.0, lend_gib: float = 40.0, executor_sms: int | None = None,
           transfer_GBps: float = PEER_GBPS, horizon_factor: float = 3.0) -> dict[str, Any]:
    geo = load_geometry(m.model, m.expert_distribution)
    cost = CostModel(cal, geo)
    gp, gd = SimGpu(0, executor_sms=executor_sms), SimGpu(1)
    lend = lend_gib if offload_ratio > 0 else 0.0
    p = Instance(InstanceSpec("prefill", m.name, pool_tokens_for(geo, FULL, gpu_mem_gib, lend), m.ttft_s, m.tpot_s,
                              context=m.context), cost, gp)
    d = Instance(InstanceSpec("decode", m.name, pool_tokens_for(geo, FULL, gpu_mem_gib), m.ttft_s, m.tpot_s,
                              context=m.context, decode_only=True, offload_ratio=offload_ratio,
                              executor_tokens=int(lend * GiB / geo.kv_bytes_per_token)),
                 cost, gd, gp if offload_ratio > 0 else None, peer_GBps=float("inf"))
    reqs = make_requests(m, seconds, seed)
    out_len: dict[str, int] = {}
    prompts: dict[str, list[int]] = {}
    for k, (t, prompt, n) in enumerate(reqs):
        rid = f"{m.name}/{k}"
        p.add(rid, t, prompt, 1)
        out_len[rid], prompts[rid] = n, prompt
    handed = 0

    def hand_over(inst: Instance) -> None:
        nonlocal handed
        if inst is not p:
            return
        for rid in p.finished[handed:]:
            ts = p.times[rid]
            if out_len[rid] > 1 and ts and rid not in p.failed:
                at = ts[0] + len(prompts[rid]) * cost.kv_bytes_per_token / (transfer_GBps * 1e9)
                d.add(rid, at, prompts[rid] + [0], out_len[rid] - 1)
        handed = len(p.finished)

    run_instances([p, d], seconds * horizon_factor, hand_over)
    times = {rid: p.times.get(rid, [])[:1] + d.times.get(rid, []) for rid in out_len}
    res = {"arrival": {rid: p.arrival[rid] for rid in out_len}, "times": {r: ts for r, ts in times.items() if ts},
           "rotations": 0, "preemptions": p.s.num_preemptions + d.s.num_preemptions}
    summ = summarize(res, len(out_len), out_len, m.ttft_s, m.tpot_s)
    summ.update(failed=len(p.failed) + len(d.failed), remote_row_steps=d.remote_row_steps,
                prefill_slowed_s=p.slowed_s, decode_exchange_s=d.exchange_s, prefill_busy_s=p.busy_s,
                decode_busy_s=d.busy_s)
    return summ
