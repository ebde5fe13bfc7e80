"""bench/sim/knee.py and `python -m bench.sim.predict mixtral`: goodput_knee.py's strict method on the
simulator (its plan's rows, offsets and seeds; strict goodput; what binds), small enough for a CPU test."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench import goodput_knee as K
from bench.sim import knee as N
from bench.sim import predict as P
from bench.sim.cost import DEFAULT_CALIBRATION, CostModel

MOONCAKE = N.Setting("mc", "mooncake", "poisson", (0.5, 40.0), 7680, ttft=5.0)


@pytest.fixture(scope="module")
def server() -> N.Server:
    return N.Server((P.MIXTRAL_POOL_PAGES - 1) * 16, 32.0, CostModel.load(DEFAULT_CALIBRATION, "mixtral-8x7b"))


def test_point_config_is_what_goodput_knee_would_send() -> None:
    plan = K.Plan((2.0, 3.0, 4.0), 3, 20.0)  # the measured Mixtral knee's plan: offsets 0 / 150 / 300
    for k in range(3):
        cfg = N.point_config(MOONCAKE, plan, 3.0, k)
        assert (cfg["trace_offset"], cfg["seed"], cfg["num_requests"]) == (150 * k, k, 150)
        assert cfg["max_duration"] == pytest.approx(round(150 / 3 + 5 + 0.1 * 256 + 15))
        assert (cfg["max_input_len"], cfg["max_output_len"], cfg["ttft_slo"], cfg["tbt_slo"]) == (7680, 256, 5.0, 0.1)
        assert cfg["arrival"] == "poisson" and cfg["trace"] == "mooncake" and cfg["tbt_stat"] == "mean"
    burst = N.point_config(N.Setting("b", "azure-conv", "burst", (8.0,), 2048, ttft=2.0), K.Plan((8.0, 16.0)), 16, 1)
    assert burst["arrival"] == "burst" and burst["burst_factor"] == 4.0 and burst["num_requests"] == 480
    assert burst["trace_offset"] == 720  # stride: n at the highest reachable rate (24 x 30 s)


def test_search_finds_the_strict_knee_and_what_binds(server: N.Server) -> None:
    # one request every 2 s passes; 20 requests of ~6K tokens at 40 req/s cannot (Mixtral prefills ~15K
    # tokens/s: the last ones wait past the 5 s TTFT)
    plan = K.Plan(MOONCAKE.grid, repeats=2, seconds=0.5, min_req=8, tolerance=100.0)
    logs: list[str] = []
    r = N.search(MOONCAKE, ["fcfs-recompute", "lvf-rotate"], plan, server, log=logs.append)
    assert len(logs) == 4 and {(p["run"], p["rate"]) for p in r["points"]} == {
        (run, rate) for run in ("fcfs-recompute", "lvf-rotate") for rate in (0.5, 40.0)}
    for p in r["points"]:
        assert p["offsets"] == [0, 40] and len(p["repeats"]) == 2  # stride: n at 79.5, the extension
        assert [x["scheduled"] for x in p["repeats"]] == [plan.n(p["rate"])] * 2
    low = {p["run"]: p for p in r["points"] if p["rate"] == 0.5}
    high = {p["run"]: p for p in r["points"] if p["rate"] == 40.0}
    assert all(p["both"] >= 0.9 for p in low.values()) and all(p["both"] < 0.8 for p in high.values())
    # the same rows for both runs: the same mean prompt per repeat
    assert [x["mean_input"] for x in high["fcfs-recompute"]["repeats"]] == \
        [x["mean_input"] for x in high["lvf-rotate"]["repeats"]]
    for run in ("fcfs-recompute", "lvf-rotate"):
        g = r["goodput"][run]
        assert (g["goodput"], g["first_failing"], g["text"]) == (0.5, 40.0, "0.5")
        b = r["binding"][run]
        assert b["at"] == 40.0 and b["gpu_busy"] > 0.9 and b["ttft_attainment"] < 0.8
        assert 0.0 <= b["kv_held_mean"] <= b["kv_held_peak"] <= 1.0
    assert r["ratio"] == "1.00x"


def test_goodput_rules() -> None:
    plan = K.Plan((2.0, 3.0))
    assert N.goodput_of({2.0: 0.95, 3.0: 0.5}, plan)["text"] == "2"
    assert N.goodput_of({2.0: 0.5, 3.0: 0.95}, plan)["text"] == "< 2"  # a lower rate failed: no goodput
    assert N.goodput_of({2.0: 0.95, 3.0: 0.92}, plan)["lower_bound"]
    good = {"lvf-rotate": N.goodput_of({2.0: 0.95, 3.0: 0.92, 4.0: 0.3}, plan),
            "fcfs-recompute": N.goodput_of({2.0: 0.95, 3.0: 0.5}, plan)}
    assert N.ratio(good) == "1.50x"
    good["fcfs-recompute"] = N.goodput_of({2.0: 0.5}, plan)
    assert N.ratio(good).startswith("n/a")


def test_predict_mixtral_command_writes_labelled_json_and_plot(tmp_path: Path) -> None:
    assert P.main(["mixtral", "--settings", "mooncake-poisson", "--runs", "lvf-rotate", "--grid", "0.5",
                   "--repeats", "1", "--min-req", "4", "--seconds", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "mixtral.json").read_text())
    assert data["label"] == "SIMULATED" and "4.2" in data["error_band"]
    st = data["settings"]["mooncake-poisson"]
    assert st["plan"]["grid"] == [0.5] and st["plan"]["offsets"] == [0]
    # 0.5 passed, so the search tried one grid step above it (extend 1) and that passed too: a lower bound
    assert st["goodput"]["lvf-rotate"]["text"] == ">= 0.75"
    assert [p["rate"] for p in st["points"]] == [0.5, 0.75]
    assert (tmp_path / "mixtral.png").stat().st_size > 0


def test_predict_moe_on_another_card_and_share(tmp_path: Path) -> None:
    """--model/--gpu/--share: the pool from the card's memory math (an H100's total solved from its logged
    Llama pool), the card's calibration and band; a model whose weights fill the share is refused."""
    assert P.main(["mixtral", "--model", "qwen3-30b-a3b", "--gpu", "h100", "--share", "0.9", "--settings",
                   "mooncake-poisson", "--runs", "lvf-rotate", "--grid", "0.5", "--repeats", "1", "--min-req", "4",
                   "--seconds", "1", "--extend", "0", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "mixtral.json").read_text())
    # the pool the H100's Qwen3 server logged (2026-12-06 s4: 9,396 pages), not the memory math's 150,304
    assert data["setup"].startswith("qwen3-30b-a3b (preset geometry), one H100 at 0.9: pool 150,320 usable tokens")
    assert "h100.json" in data["setup"] and "DERIVED calibration" in data["error_band"]
    assert "--moe-routing-simulation uniform" in data["error_band"]
    with pytest.raises(SystemExit, match="leaves no KV pool"):  # 93 GB of Mixtral on an 80 GB card
        P.main(["mixtral", "--gpu", "h100", "--settings", "mooncake-poisson", "--out", str(tmp_path)])



def test_predict_moe_rejects_an_unknown_model_or_card(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for flag, value in (("--model", "nope"), ("--gpu", "a100")):
        with pytest.raises(SystemExit) as e:
            P.main(["mixtral", flag, value, "--out", str(tmp_path)])
        assert e.value.code == 2 and f"{flag}: unknown" in capsys.readouterr().err


def test_kvbind_settings_reach_the_gpu_tools_flags() -> None:
    # the long-output / relaxed-TPOT workloads: what serving.py would be given for their points
    sts = {st.name: st for st in P.kvbind_settings()}
    assert len(sts) == 6 and not set(sts) & {st.name for st in P.mixtral_settings()}
    st = sts["mc-out1024-tpot0.2-poisson"]
    cfg = N.point_config(st, K.Plan(st.grid, 3, 20.0), 3.0, 1)
    assert (cfg["max_output_len"], cfg["tbt_slo"], cfg["ttft_slo"], cfg["max_input_len"]) == (1024, 0.2, 5.0, 7680)
    assert cfg["max_duration"] == pytest.approx(round(150 / 3 + 5 + 0.2 * 1024 + 15))


def test_predict_mixtral_kvbind_runs_its_own_workloads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:  # a workload of the other command: a usage error naming the flag
        P.main(["mixtral-kvbind", "--settings", "mooncake-poisson", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--settings: mooncake-poisson is not a workload of mixtral-kvbind" in \
        capsys.readouterr().err
    assert P.main(["mixtral-kvbind", "--settings", "mc-out1024-poisson", "--grid", "0.5", "--repeats", "1",
                   "--min-req", "4", "--seconds", "1", "--extend", "0", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "mixtral-kvbind.json").read_text())
    assert data["label"] == "SIMULATED" and data["runs"] == ["fcfs-recompute", "lvf-rotate"]
    st = data["settings"]["mc-out1024-poisson"]
    assert (st["setting"]["max_out"], st["setting"]["tpot"]) == (1024, 0.1)
    assert {p["run"] for p in st["points"]} == {"fcfs-recompute", "lvf-rotate"}
    # the requests keep Mooncake's own output lengths (up to 1,024), not the 256 cap of `mixtral`
    assert all(p["n"] == 4 for p in st["points"]) and st["goodput"]["lvf-rotate"]["text"] == ">= 0.5"
    assert all(p["repeats"][0]["mean_output"] == (500 + 490 + 794 + 316) / 4 for p in st["points"])
    assert (tmp_path / "mixtral-kvbind.png").stat().st_size > 0
    assert not (tmp_path / "mixtral.json").exists()


def test_predict_pool_scale_and_host_gb_label_their_server_and_reuse_keeps_to_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--pool-scale searches with a scaled pool (the ceiling no KV policy passes) and says so, --host-gb sizes
    the host pool rotation writes to; --reuse takes no point from a file of another server (pool, host pool,
    card, model), only from one of the same."""
    args = ["mixtral-kvbind", "--settings", "mc-out1024-poisson", "--runs", "fcfs-recompute", "--grid", "0.5",
            "--repeats", "1", "--min-req", "4", "--seconds", "1", "--extend", "0", "--no-pool-check"]
    assert P.main([*args, "--out", str(tmp_path / "real")]) == 0
    assert P.main([*args, "--pool-scale", "4", "--out", str(tmp_path / "x4")]) == 0
    real = json.loads((tmp_path / "real" / "mixtral-kvbind.json").read_text())
    x4 = json.loads((tmp_path / "x4" / "mixtral-kvbind.json").read_text())
    pool = (P.MIXTRAL_POOL_PAGES - 1) * 16
    assert f"pool {pool:,} usable tokens" in real["setup"] and "COUNTERFACTUAL" not in real["setup"]
    assert f"pool {4 * pool:,} usable tokens" in x4["setup"] and "scaled x4: a COUNTERFACTUAL pool" in x4["setup"]
    assert "COUNTERFACTUAL" in capsys.readouterr().out
    assert "32 GiB host pool" in real["setup"]
    assert P.main([*args, "--host-gb", "64", "--out", str(tmp_path / "h64")]) == 0
    h64 = json.loads((tmp_path / "h64" / "mixtral-kvbind.json").read_text())
    assert "64 GiB host pool" in h64["setup"]
    st = dataclasses.replace(P.kvbind_settings()[0], grid=(0.5,))
    plan = K.Plan(st.grid, 1, 1.0, 4, 0.9, K.TOLERANCE, 0)
    f = tmp_path / "real" / "mixtral-kvbind.json"
    assert set(P._reusable(f, st, plan, real["setup"])) == {("fcfs-recompute", 0.5)}
    assert P._reusable(f, st, plan, x4["setup"]) == {} and P._reusable(f, st, plan, h64["setup"]) == {}
    with pytest.raises(SystemExit) as e:
        P.main([*args, "--pool-scale", "0", "--out", str(tmp_path / "bad")])
    assert e.value.code == 2 and "--pool-scale: 0 is not a positive factor" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        P.main([*args, "--host-gb", "-1", "--out", str(tmp_path / "bad")])
    assert e.value.code == 2 and "--host-gb: -1 is not a positive size" in capsys.readouterr().err


def test_pool_check_tells_kv_from_compute(server: N.Server) -> None:
    long_out = N.Setting("mc-long", "mooncake", "poisson", (0.5,), 7680, 1024, 5.0, 0.2)
    plan = K.Plan(long_out.grid, repeats=1, seconds=0.5, min_req=6)
    # a pool of ~two Mooncake requests: six long requests 2 s apart queue for room and miss TTFT 5 s ...
    small = N.Server(12_000, 32.0, server.cost)
    assert N.point(long_out, plan, "fcfs-recompute", 0.5, small)["mean"]["ttft"] < 0.9
    # ... and with 30x that pool they pass: KV bound them
    c = N.pool_check(long_out, plan, "fcfs-recompute", 0.5, small, 30.0)
    assert c["passes"] and c["verdict"].startswith("KV binds") and c["factor"] == 30.0
    # 20 prefills of ~6K tokens at 40 req/s miss TTFT with any pool: compute binds
    busy = N.pool_check(MOONCAKE, K.Plan(MOONCAKE.grid, 1, 0.5, 8), "fcfs-recompute", 40.0, server, 2.0)
    assert not busy["passes"] and busy["verdict"].startswith("compute")


def test_search_reuses_an_earlier_searchs_points(server: N.Server) -> None:
    plan = K.Plan(MOONCAKE.grid, repeats=1, seconds=0.5, min_req=4, tolerance=100.0)
    first = N.search(MOONCAKE, ["fcfs-recompute"], plan, server, log=lambda _: None)
    reuse = {(p["run"], p["rate"]): p for p in first["points"]}
    again = N.search(MOONCAKE, ["fcfs-recompute"], plan, server, log=lambda _: None, reuse=reuse)
    assert again["points"] == first["points"] and again["goodput"] == first["goodput"]
    assert all(any(p is q for q in reuse.values()) for p in again["points"])  # taken, not replayed


def test_a_variant_run_carries_its_scheduler_option(server: N.Server) -> None:
    """`lvf-rotate.missed` (goodput_knee.py's name for lvf with --lvf-missed-last) runs the real Scheduler
    with that option; an unknown variant is refused by name, not simulated as the plain run."""
    from bench.policy_sim import Clock, make_scheduler

    assert N.variant_args("lvf-rotate") is None
    assert N.variant_args("lvf-rotate.missed") == {"lvf_missed_last": True}
    with pytest.raises(SystemExit, match="knows the variants missed"):
        N.variant_args("lvf-rotate.fast")
    s = make_scheduler("lvf", "rotate", 20_000, 1.0, 5.0, 0.2, Clock(), server.cost, 16, 1024, skip_forward=True,
                       extra=N.variant_args("lvf-rotate.missed"))
    assert s.policy.missed_last  # type: ignore[attr-defined]
    plan = K.Plan((0.5,), repeats=1, seconds=0.5, min_req=4)
    p = N.point(MOONCAKE, plan, "lvf-rotate.missed", 0.5, server)
    assert p["run"] == "lvf-rotate.missed" and p["both"] >= 0.9
