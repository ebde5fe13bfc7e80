"""The fleet simulator (bench/sim/instance.py, fleet.py, plan.py): the event loop, the equivalence with
bench/policy_sim.py, what WEAVER pairings charge to whom, and the plan command."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench import policy_sim as ps
from bench.sim import plan as plan_cmd
from bench.sim.cost import CostModel, GiB
from bench.sim.fleet import FleetPlan, ModelSpec, Pairing, Slot, load_gpu, run_fleet
from bench.sim.instance import Instance, InstanceSpec, SimGpu, gpu_calibration, known_gpus, run_instances, with_link

EXAMPLE = Path(__file__).resolve().parents[1] / "bench" / "sim" / "examples" / "models.yaml"

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel.load(None, "llama-3-8b")


def synthetic(n: int, rate: float, n_in: int, n_out: int, seed: int) -> list[tuple[float, list[int], int]]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return [(float(t[i]), rng.integers(2, ps.VOCAB, n_in).tolist(), n_out) for i in range(n)]


def test_event_loop_orders_by_clock_and_conserves_requests(cost: CostModel, monkeypatch: pytest.MonkeyPatch) -> None:
    g0, g1 = SimGpu(0), SimGpu(1)
    insts = [Instance(InstanceSpec(f"m{i}", f"m{i}", 8192, 2.0, 0.1, context=4096), cost, g)
             for i, g in enumerate((g0, g0, g1))]
    for i, inst in enumerate(insts):
        for k, (t, ids, n) in enumerate(synthetic(12, 4.0, 300 + 100 * i, 20, i)):
            inst.add(f"m{i}/{k}", t, ids, n)
    # one request larger than the whole pool: it must come back failed, not vanish
    insts[2].add("m2/huge", 0.5, list(range(2, 300)) * 30, 4)
    horizon = 60.0
    order: list[tuple[float, float]] = []
    advance = Instance.advance

    def spy(self: Instance) -> None:
        order.append((self.next_time(horizon), min(i.next_time(horizon) for i in insts)))
        advance(self)

    monkeypatch.setattr(Instance, "advance", spy)
    n = run_instances(insts, horizon)
    assert n == len(order) > 30
    assert all(chosen == earliest for chosen, earliest in order)  # always the instance that acts earliest
    for inst in insts:
        for rid, n_out in inst.out_len.items():
            finished = len(inst.times[rid]) == n_out
            assert finished != (rid in inst.failed), rid  # finished, or reported failed: never lost
    assert "m2/huge" in insts[2].failed
    # two instances on one GPU never run at once: its busy time fits in the span it was used
    assert g0.busy_s <= max(i.clock.t for i in insts[:2]) + 1e-9


def test_dedicated_one_model_fleet_equals_policy_sim(cost: CostModel) -> None:
    reqs = ps.workload("mooncake", 30.0, 30, 0, 2048, 64, 0)
    pool, ttft, tpot = 6_000, 2.0, 0.1
    clock = ps.Clock()
    s = ps.make_scheduler("lvf", "rotate", pool, 8.0, ttft, tpot, clock, cost, 16, 2048 + 64 + 16)
    res = ps.replay(s, clock, reqs, horizon_s=30.0)
    out_len = {f"q{i}": r[2] for i, r in enumerate(reqs)}
    want = ps.summarize(res, len(reqs), out_len, ttft, tpot)
    inst = Instance(InstanceSpec("x", "x", pool, ttft, tpot, policy="lvf", mode="rotate", host_gb=8.0,
                                 context=2048 + 64 + 16), cost, SimGpu(0))
    for i, (t, ids, n) in enumerate(reqs):
        inst.add(f"q{i}", t, ids, n)
    run_instances([inst], 30.0)
    got = ps.summarize(inst.result(), len(reqs), out_len, ttft, tpot)
    assert want["rotations_out"] > 0 or want["preemptions"] > 0  # the pool is under pressure
    assert got == want


def _pair(cost: CostModel, ratio: float) -> tuple[Instance, Instance]:
    g0, g1 = SimGpu(0), SimGpu(1)
    hot = Instance(InstanceSpec("hot", "hot", 60_000, 2.0, 0.1, offload_ratio=ratio, executor_tokens=60_000,
                                context=4200), cost, g0, g1 if ratio else None)
    cold = Instance(InstanceSpec("cold", "cold", 60_000, 2.0, 0.1, context=4200), cost, g1)
    for k, (t, ids, n) in enumerate(synthetic(40, 8.0, 3000, 48, 1)):
        hot.add(f"h/{k}", t, ids, n)
    for k, (t, ids, n) in enumerate(synthetic(10, 2.0, 500, 48, 2)):
        cold.add(f"c/{k}", t, ids, n)
    return hot, cold


def test_weaver_charges_exchange_to_hot_and_slowdown_to_cold(cost: CostModel,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    hot0, cold0 = _pair(cost, 0.0)
    run_instances([hot0, cold0], 60.0)
    assert hot0.exchange_s == 0.0 and cold0.slowed_s == 0.0
    # the cold GPU's slowdown is the cost model's host_increase of the guest KV held now
    hot, cold = _pair(cost, 0.5)
    seen: list[tuple[float, float]] = []
    slowdown = SimGpu.slowdown

    def spy(self: SimGpu, c: CostModel) -> float:
        v = slowdown(self, c)
        seen.append((v, c.host_increase(self.guest_gib())))
        return v

    monkeypatch.setattr(SimGpu, "slowdown", spy)
    run_instances([hot, cold], 60.0)
    assert hot.remote_steps > 0 and hot.remote_row_steps >= hot.remote_steps
    base, per_row = (float(cost.cal.remote_exchange["lean"][k] or 0) for k in ("base_us", "per_row_us"))
    assert base > 0 and per_row > 0
    want = cost.geo.layers * 1e-6 * (base * hot.remote_steps + per_row * hot.remote_row_steps)
    assert hot.exchange_s == pytest.approx(want, rel=1e-9)  # exchange: on the hot model's steps only
    assert cold.exchange_s == 0.0 and hot.slowed_s == 0.0  # slowdown: on the cold model's steps only
    assert cold.slowed_s > 0 and any(v > 0 for v, _ in seen)
    assert all(v == pytest.approx(w) for v, w in seen)
    assert cold.busy_s > cold0.busy_s


def test_cold_steps_are_longer_by_host_increase(cost: CostModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SimGpu, "slowdown", lambda self, c: 0.25 if self.guest_gib() > 0 else 0.0)
    hot, cold = _pair(cost, 0.5)
    run_instances([hot, cold], 60.0)
    # every slowed step is 1.25 x its base: the time lost is 0.25 / 1.25 of the slowed steps' time
    assert cold.slowed_s > 0
    assert cold.slowed_s <= 0.2 * cold.busy_s + 1e-12


def test_guest_gib_and_host_increase(cost: CostModel) -> None:
    g = SimGpu(1)
    hot, _ = _pair(cost, 0.5)
    g.senders.append(hot)
    hot.remote_kv_tokens = lambda: int(16 * GiB / cost.kv_bytes_per_token)  # type: ignore[method-assign]
    assert g.guest_gib() == pytest.approx(16.0, rel=1e-6)
    assert g.slowdown(cost) == pytest.approx(cost.host_increase(16.0))
    g.executor_sms = 8
    assert g.slowdown(cost) == pytest.approx(cost.host_increase(16.0, 8))


def test_run_fleet_weaver_plan_reports_per_model() -> None:
    cal, mem = load_gpu("h200")
    models = [ModelSpec("hot", "llama-3-8b", 4.0, trace="mooncake", max_in=4096, max_out=64),
              ModelSpec("cold", "llama-3.2-1b", 4.0, trace="azure-conv", max_in=2048, max_out=64)]
    plan = FleetPlan(2, [Slot("hot", 0, 0.9), Slot("cold", 1, 0.9)], [Pairing(0, 1, 0.5, 8.0)])
    r = run_fleet(plan, models, cal, mem, seconds=4.0)
    assert set(r.per_model) == {"hot", "cold"} and r.scheduled == 16 + 16
    assert r.per_model["hot"]["remote_row_steps"] > 0 and r.per_model["cold"]["slowed_by_guests_s"] > 0
    for s in r.per_model.values():
        assert s["finished"] + s["unfinished"] == s["scheduled"]
        assert 0.0 <= s["attainment"] <= min(s["ttft_attainment"], s["tpot_attainment"]) <= 1.0
    assert r.as_dict()["label"] == "SIMULATED"


def test_link_variant_changes_only_the_link() -> None:
    cal, _ = load_gpu("h200")
    c2c = with_link(cal, 450.0)
    assert c2c.host_link["d2h_GBps"] == 450.0 and c2c.host_link["duplex_GBps"] == 900.0
    assert c2c.decode == cal.decode and c2c.remote_exchange == cal.remote_exchange


def test_plan_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        plan_cmd.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--models" in out and "--gpu" in out and "--traffic" in out and "h200" in out


def test_plan_runs_the_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    rc = plan_cmd.main(["--models", str(EXAMPLE), "--gpu", "h200", "--traffic", "servegen", "--total-rate", "3",
                        "--seconds", "3", "--strategy", "dedicated", "--scales", "1", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "SIMULATED" in text and "gpu0:" in text and "chat-mid" in text
    import json

    data: dict[str, Any] = json.loads(out.read_text())
    best = data["strategies"]["dedicated"]["result"]
    assert data["label"] == "SIMULATED" and set(best["per_model"]) == {"chat-mid", "chat-small", "chat-large",
                                                                        "reasoning", "vision"}


def test_unknown_gpu_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "h200" in known_gpus()
    with pytest.raises(ValueError, match=r"unknown GPU 'a100'.*h200"):
        gpu_calibration("a100")
    rc = plan_cmd.main(["--models", str(EXAMPLE), "--gpu", "a100", "--total-rate", "3", "--traffic", "servegen"])
    assert rc == 2
    assert "unknown GPU 'a100'" in capsys.readouterr().err


def test_lent_memory_comes_from_each_model_by_its_room() -> None:
    cal, mem = load_gpu("h200")
    models = [ModelSpec("hot", "llama-3-8b", 2.0, max_in=1024, max_out=16),
              ModelSpec("moe", "qwen3-30b-a3b", 0.5, max_in=1024, max_out=16),
              ModelSpec("small", "llama-3.2-1b", 0.5, max_in=1024, max_out=16)]
    # the MoE's 0.45 share leaves it ~4 GiB of KV room, the 1B's 0.225 ~27 GiB: lending half of the sum
    # by memory share would take more than the MoE has
    plan = FleetPlan(2, [Slot("hot", 0, 0.9), Slot("moe", 1, 0.45), Slot("small", 1, 0.225)],
                     [Pairing(0, 1, 0.5, 15.0)])
    r = run_fleet(plan, models, cal, mem, seconds=2.0)
    assert r.per_model["moe"]["finished"] == r.per_model["moe"]["scheduled"]


def test_pd_hands_requests_over_and_adrenaline_charges_the_prefill_gpu() -> None:
    from bench.sim.pd import run_pd

    cal, mem = load_gpu("h200")
    m = ModelSpec("m", "llama-3-8b", 6.0, trace="mooncake", max_in=2048, max_out=32)
    plain = run_pd(m, cal, mem, seconds=3.0)
    assert plain["finished"] == plain["scheduled"] == 18 and plain["failed"] == 0
    assert plain["remote_row_steps"] == 0 and plain["prefill_slowed_s"] == 0.0
    ad = run_pd(m, cal, mem, seconds=3.0, offload_ratio=0.5, lend_gib=8.0, executor_sms=24)
    assert ad["finished"] == ad["scheduled"] and ad["remote_row_steps"] > 0
    assert ad["prefill_slowed_s"] > 0 and ad["decode_exchange_s"] > 0


def test_decode_only_instance_prices_no_prefill(cost: CostModel) -> None:
    inst = Instance(InstanceSpec("d", "d", 20_000, 2.0, 0.1, context=4096, decode_only=True), cost, SimGpu(0))
    for k, (t, ids, _) in enumerate(synthetic(5, 4.0, 1500, 1, 3)):
        inst.add(f"r{k}", t, ids, 1)  # prompt only: its KV "arrived", one token out of a free forward
    run_instances([inst], 10.0)
    assert len(inst.finished) == 5 and inst.busy_s == 0.0
