"""bench/sim/replay_sweeps.py: the replay rebuilds serving.py's requests, sizes the pool as the server
did, and predicts a saved report end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench import serving
from bench.policy_sim import VOCAB, serving_workload, workload
from bench.sim import replay_sweeps as R
from bench.sim.cost import CostModel
from bench.traces import WorkloadConfig, build_requests

BURST = R.RESULTS / "2026-12-02-h200-s3/c2-burst-share05/goodput/gp_lvf-rotate-burst_r4.json"
KNEE = R.RESULTS / "2026-12-03-h200/c1-poisson-share025-ttft2/knee/gp_lvf-rotate_r5_k2.json"
AZURE = R.RESULTS / "2026-12-02-h200/c5-window-sampling-azure-share025/goodput/gp_fcfs-recompute_r24.json"


@pytest.mark.parametrize("path", [BURST, KNEE, AZURE])
def test_replay_rebuilds_the_rows_and_arrival_times_serving_py_sent(path: Path) -> None:
    report = json.loads(path.read_text())
    if report["command"][0].endswith("serving.py"):
        # what serving.py builds from the command line it ran (argv -> its parser -> its WorkloadConfig)
        args = serving.build_parser().parse_args(report["command"][1:])
        args.traces_dir = R.repo_root() / args.traces_dir
        cfg = serving.workload_config(args)
    else:  # bench/goodput_knee.py called serving in-process: repeat k replays offset k x 150, arrival seed k
        cfg = WorkloadConfig(trace="mooncake", arrival="poisson", request_rate=5.0, num_requests=150,
                             trace_offset=300, max_input_len=7680, max_output_len=256, seed=2)
    specs, info = build_requests(cfg)
    mine = serving_workload(R.serving_config(report["config"]))
    assert len(mine) == len(specs) == report["workload"]["scheduled"]
    assert [t for t, _, _ in mine] == [s.arrival_s for s in specs]
    assert [len(ids) for _, ids, _ in mine] == [s.input_len for s in specs]
    assert [n for _, _, n in mine] == [s.output_len for s in specs]
    assert all(2 <= t < VOCAB for _, ids, _ in mine for t in ids)
    # and what the report says serving.py sent
    assert info["schedule_span_s"] == pytest.approx(report["workload"]["schedule_span_s"], abs=1e-9)
    assert info["mean_input_len"] == pytest.approx(report["workload"]["mean_input_len"])
    assert info["mean_output_len"] == pytest.approx(report["workload"]["mean_output_len"])


def test_folded_prompts_keep_shared_prefixes_shared() -> None:
    reqs = workload("mooncake", 4.0, 20, 0, 7680, 256, 0)
    firsts = [tuple(ids[:512]) for _, ids, _ in reqs]
    assert len(set(firsts)) < len(firsts)  # the trace's shared hash blocks survive the folding


def test_pool_from_the_server_log_and_the_memory_math_agree() -> None:
    total, other = R.memory_constants()
    assert 139 * R.GiB < total < 141 * R.GiB and 0 < other < 2 * R.GiB
    sweep = next(sw for pn in R.PANELS for sw in pn.sweeps if sw.folder.endswith("c2-burst-share05/goodput"))
    tokens, source = R.pool_tokens(BURST, "lvf-rotate", sweep, (total, other))
    assert tokens == (27810 - 1) * 16 and source.startswith("server log")
    # every logged pool is reproduced by the memory math within 0.5 % (llama at four shares, qwen at one)
    for pn in R.PANELS:
        for sw in pn.sweeps:
            if sw.gpu != "h200":
                continue  # another card: the H200's memory math does not apply
            for log in (R.RESULTS / sw.folder).glob("gp_server_*.log"):
                got = R.logged_pool(log)
                assert got is not None
                assert R.pages_from_share(sw.share, sw.model, 16, total, other) == pytest.approx(got[0], rel=5e-3)
    # a folder without logs (2026-12-01) falls back to the math
    old = R.PANELS[0].sweeps[0]
    path = R.RESULTS / old.folder / "gp_lvf-rotate_r6.json"
    tokens, source = R.pool_tokens(path, "lvf-rotate", old, (total, other))
    assert source.startswith("memory math") and abs(tokens - 9915 * 16) <= 16 * 16


def test_one_saved_report_replays_to_an_attainment(tmp_path: Path) -> None:
    report = json.loads(BURST.read_text())
    report["config"]["num_requests"] = 12  # the first 12 of its rows: a fast smoke
    sweep = R.Sweep("x", 0.5)
    pred = R.predict(report, "lvf-rotate", 16384, sweep, CostModel.load())
    assert pred["scheduled"] == 12
    for key in ("both", "ttft", "tbt"):
        assert 0.0 <= pred[key] <= 1.0
    assert pred["both"] <= min(pred["ttft"], pred["tbt"])
    m = R.measured(json.loads(BURST.read_text()))
    assert m["both"] == pytest.approx(0.9)


def test_cli_lists_panels_and_rejects_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    assert R.main(["--list"]) == 0
    assert "qwen2.5-32b" in capsys.readouterr().out
    assert R.main(["--panels", "no-such-panel"]) == 2


def test_what_if_adds_server_arguments_and_rejects_bad_specs(capsys: pytest.CaptureFixture[str]) -> None:
    """--what-if RUN=FLAGS: a malformed spec or an unknown flag is an error, not a silent plain replay; a
    good one reaches the simulated scheduler's policy."""
    assert R.main(["--panels", "qwen3", "--what-if", "lvf-rotate"]) == 2
    assert "want RUN=FLAGS" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        R.main(["--panels", "qwen3", "--what-if", "lvf-rotate=--no-such-flag"])
    report = json.loads(KNEE.read_text())
    report["config"]["num_requests"] = 12
    pred = R.predict(report, "lvf-rotate", 16384, R.Sweep("x", 0.25), CostModel.load(),
                     extra={"lvf_missed_last": True})
    assert pred["scheduled"] == 12 and 0.0 <= pred["both"] <= 1.0
    from bench.policy_sim import Clock, make_scheduler
    from sglang_ext.scheduler.policy import LargestVLTFirst

    for on in (False, True):
        s = make_scheduler("lvf", "rotate", 16384, 1.0, 2.0, 0.1, Clock(), CostModel.load(), 16, 1024,
                           skip_forward=True, extra={"lvf_missed_last": True} if on else None)
        assert isinstance(s.policy, LargestVLTFirst) and s.policy.missed_last is on


def test_a_variant_the_simulator_reads_is_replayed_with_its_own_arguments(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A knee's variant run (POLICY-MODE.NAME) whose args the simulated scheduler reads (--lvf-missed-last)
    is replayed as its policy with those args; one it cannot price (an executor on the GPU), or whose args
    the folder does not record, is skipped."""
    folder = tmp_path / "panel"
    folder.mkdir()
    (folder / "goodput.json").write_text(json.dumps({"variants": {
        "missed": ["--lvf-missed-last"], "fixed": ["--offload-executor", "local", "--offload-ratio", "0.5"]}}))
    for label in ("lvf-rotate", "lvf-rotate.missed", "lvf-rotate.fixed", "lvf-rotate.gone"):
        (folder / f"gp_{label}_r3_k0.json").write_text("{}")
    assert R.run_of("lvf-rotate.missed") == ("lvf", "rotate") == R.run_of("lvf-rotate-burst")
    assert R.variant_kwargs(folder, "lvf-rotate") == {}
    assert R.variant_kwargs(folder, "lvf-rotate.missed") == {"lvf_missed_last": True}
    assert R.variant_kwargs(folder, "lvf-rotate.missed-burst") == {"lvf_missed_last": True}
    assert R.variant_kwargs(folder, "lvf-rotate.fixed") is None
    assert R.variant_kwargs(folder, "lvf-rotate.gone") is None
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    found = R.reports(R.Panel("p", (R.Sweep("panel", 0.9),)))
    assert [label for _, _, label, _, _ in found] == ["lvf-rotate", "lvf-rotate.missed"]


def test_goodput_table_uses_the_strict_rule() -> None:
    def row(rate: float, meas: float, pred: float) -> R.Row:
        return R.Row("p", "f", "x.json", "lvf-rotate", rate, 0, 100, 1, "s", {"both": meas, "ttft": 1, "tbt": 1},
                     {"both": pred, "ttft": 1, "tbt": 1}, 0, 0, 0.0)

    # measured: 3 passes, 4 fails -> 3; predicted: 3 fails -> "< 3" (one step apart: index -1 vs 0)
    t = R.goodput_table([row(3, 0.95, 0.8), row(4, 0.5, 0.95), row(5, 0.4, 0.3)])[0]
    assert (t["measured"], t["predicted"], t["steps_apart"], t["within_one_step"]) == ("3", "< 3", 1, True)
    assert t["attainment_mae_points"] == pytest.approx(100 * (0.15 + 0.45 + 0.1) / 3)


def test_host_time_is_charged_to_prefill_steps_only() -> None:
    c = CostModel.load()
    loop = c.cal.raw["loop"]
    assert 0 < loop["plain_host_us"] < 5000 and 0 <= loop["plain_host_row_us"] < 100  # fitted, in bounds
    decode = ([1, 1, 1], [900, 1200, 5000])
    assert c.forward_s(*decode, host=True) == c.forward_s(*decode)  # overlapped in the engine: GPU time only
    mixed = ([4096, 1, 1], [4096, 1200, 5000])
    extra = c.forward_s(*mixed, host=True) - c.forward_s(*mixed)
    assert extra == pytest.approx((loop["plain_host_us"] + 3 * loop["plain_host_row_us"]) * 1e-6)


MIXTRAL = R.RESULTS / "2026-12-03-h200-s5/c3-mixtral-knee/gp_lvf-rotate_r3_k1.json"


def test_the_mixtral_knee_folder_is_a_panel_with_its_logged_pool_and_moe_clock() -> None:
    panel = next(pn for pn in R.PANELS if "mixtral" in pn.name)
    (sw,) = panel.sweeps
    assert (sw.share, sw.model, sw.host_gb) == (0.9, "mixtral-8x7b", 32.0)
    found = R.reports(panel)  # the knee's per-repeat files: gp_<run>_r<rate>_k<repeat>.json
    assert sorted((label, rate, k) for _, _, label, rate, k in found) == [
        ("lvf-rotate", rate, k) for rate in (2.0, 3.0) for k in (0, 1, 2)]
    tokens, source = R.pool_tokens(MIXTRAL, "lvf-rotate", sw, R.memory_constants())
    assert tokens == (19550 - 1) * 16 and source == "server log (19550 pages)"
    assert R.weight_bytes("mixtral-8x7b") / R.GiB == pytest.approx(86.99, abs=0.01)  # the log's weights
    report = json.loads(MIXTRAL.read_text())
    assert (report["config"]["ttft_slo"], report["config"]["tbt_slo"]) == (5.0, 0.1)
    assert R.measured(report)["both"] == pytest.approx(10 / 150)
    report["config"]["num_requests"] = 10  # a fast smoke on the MoE clock (prefill term included)
    cost = CostModel.load(model="mixtral-8x7b")
    assert cost.has_moe_prefill()
    pred = R.predict(report, "lvf-rotate", tokens, sw, cost)
    assert pred["scheduled"] == 10 and 0.0 <= pred["both"] <= 1.0 and pred["ttft_median_ms"] > 0


def test_the_uniform_mixtral_panel_pairs_fcfs_and_lvf_with_pools_from_every_call() -> None:
    """The Mixtral panel of sessions 8-9 (five calls merged): fcfs at 2 and 2.25, lvf at 2, 2.25 and 2.5, x 3
    repeats; the last call's (lvf's) server log on top, the others under calls/, all naming the same pool."""
    panel = next(pn for pn in R.PANELS if pn.name == "12-06 h200 mixtral 0.9 uniform")
    (sw,) = panel.sweeps
    assert (sw.share, sw.model, sw.gpu) == (0.9, "mixtral-8x7b", "h200")
    found = R.reports(panel)
    assert sorted((label, rate, k) for _, _, label, rate, k in found) == sorted(
        [("fcfs-recompute", r, k) for r in (2.0, 2.25) for k in (0, 1, 2)]
        + [("lvf-rotate", r, k) for r in (2.0, 2.25, 2.5) for k in (0, 1, 2)])
    folder = R.RESULTS / sw.folder
    assert not (folder / "gp_server_fcfs-recompute.log").exists()
    assert len(list((folder / "calls").glob("*/gp_server_*.log"))) == 4
    for _, path, run, _, _ in found:
        assert R.pool_tokens(path, run, sw, R.memory_constants()) == ((19550 - 1) * 16, "server log (19550 pages)")
    report = json.loads((folder / "gp_lvf-rotate_r2_k1.json").read_text())
    assert (report["config"]["tbt_slo"], report["config"]["max_output_len"]) == (0.2, 1024)
    assert R.measured(report)["both"] == pytest.approx(147 / 150)
    assert R.measured(json.loads((folder / "gp_fcfs-recompute_r2.25_k0.json").read_text()))["both"] == \
        pytest.approx(111 / 150)


def test_goodput_table_gives_the_mean_curve_per_rate() -> None:
    def row(rate: float, k: int, meas: float, pred: float) -> R.Row:
        return R.Row("p", "f", "x.json", "lvf-rotate", rate, k, 150, 1, "s", {"both": meas, "ttft": 1, "tbt": 1},
                     {"both": pred, "ttft": 1, "tbt": 1}, 0, 0, 0.0)

    rows = [row(2, 0, 0.95, 0.97), row(2, 1, 0.95, 0.95), row(2, 2, 0.88, 0.90),
            row(3, 0, 0.04, 0.20), row(3, 1, 0.07, 0.13), row(3, 2, 0.05, 0.03)]
    t = R.goodput_table(rows)[0]
    assert (t["measured"], t["predicted"]) == ("2", "2")
    two, three = t["by_rate"]
    assert (two["rate"], two["repeats"], two["requests"]) == (2, 3, 450)
    assert two["measured"] == pytest.approx((0.95 + 0.95 + 0.88) / 3)
    assert two["measured_range"] == [0.88, 0.95] and three["predicted_range"] == [0.03, 0.20]
    assert three["error_points"] == pytest.approx(100 * ((0.20 + 0.13 + 0.03) - (0.04 + 0.07 + 0.05)) / 3)


def _pt(panel: str, both: float, tpot: tuple[float, float], ttft: tuple[float, float], pred_both: float) -> dict:
    return {"panel": panel, "measured": {"both": both, "tpot_mean_ms": tpot[0], "ttft_median_ms": ttft[0]},
            "predicted": {"both": pred_both, "tpot_mean_ms": tpot[1], "ttft_median_ms": ttft[1]}}


def test_latency_bias_by_load_and_from_a_saved_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    points = [_pt("a", 0.95, (20.0, 18.0), (300.0, 270.0), 0.97),  # passing: 10 % fast on both
              _pt("a", 0.97, (30.0, 33.0), (200.0, 200.0), 0.97),  # passing: 10 % slow on TPOT
              _pt("b", 0.60, (40.0, 36.0), (2000.0, 1000.0), 0.80),  # near the knee
              _pt("b", 0.20, (50.0, float("nan")), (4000.0, 3000.0), 0.30)]  # a nan leaves it out
    bands = {b["band"]: b for b in R.latency_bias(points)}
    assert set(bands) == {"passing (measured >= 90 %)", "near the knee (50-90 %)", "all"}
    passing = bands["passing (measured >= 90 %)"]
    assert passing["points"] == 2 and passing["tpot_median_rel"] == pytest.approx(0.0)  # -10 % and +10 %
    assert passing["tpot_under_share"] == 0.5 and passing["ttft_median_rel"] == pytest.approx(-0.05)
    near = bands["near the knee (50-90 %)"]
    assert near["ttft_median_rel"] == pytest.approx(-0.5) and near["both_median_error_points"] == pytest.approx(20.0)
    assert bands["all"]["points"] == 3
    saved = tmp_path / "replay.json"
    saved.write_text(json.dumps({"points": points}))
    assert R.main(["--bias-from", str(saved), "--panels", "b"]) == 0
    out = capsys.readouterr().out
    assert "near the knee (50-90 %)" in out and "passing" not in out and "TTFT p50 -50.0 %" in out


def test_a_merged_panel_takes_its_pool_from_an_earlier_call_and_skips_variant_runs() -> None:
    """The adaptive panel of 2026-12-06: the 'off' server ran only in the first of its two calls (its log is
    under calls/), and the fixed/adaptive variants (an in-process executor on the same GPU) are not priced."""
    panel = next(pn for pn in R.PANELS if "azure off" in pn.name)
    (sw,) = panel.sweeps
    assert sw.gpu == "h100"
    found = R.reports(panel)
    assert {label for _, _, label, _, _ in found} == {"fcfs-recompute"}
    assert sorted((rate, k) for _, _, _, rate, k in found) == [(12.0, k) for k in (0, 1, 2)]
    folder = R.RESULTS / sw.folder
    assert any(folder.glob("gp_fcfs-recompute.adaptive_r*.json"))  # there, but skipped
    assert not (folder / "gp_server_fcfs-recompute.log").exists()
    tokens, source = R.pool_tokens(found[0][1], "fcfs-recompute", sw, R.memory_constants())
    assert tokens == (12291 - 1) * 16 and source == "server log (12291 pages)"


def test_step_check_prices_the_decode_only_steps_a_server_logged(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A panel whose servers logged a step profile: each point's decode-only step (rows, mean pool use)
    is priced by the cost model beside what was measured; a panel without one gives no check."""
    from bench import step_profile

    folder = tmp_path / "panel"
    folder.mkdir()
    line = ("[w0] INFO sglang_ext.worker.step_log: w0: steps 100 (50.0/s, 20.0 ms mean, 10 % with a prefill, "
            "0 % overlapped) | running 12.0 (remote 0.0) waiting 0.5 | rows 12.0 | tokens out 600/s, prefill "
            "9000/s | executor wait 0.0 % (loads 0) | kv 40 % mean, 70 % peak | decode-only forwards 90 x 11.0 ms at "
            "12.0 rows")
    (folder / "gp_server_lvf-rotate.log").write_text(
        f"{step_profile.POINT_MARK} begins 3 0\n{line}\n{step_profile.POINT_MARK} ends 3 0\n")
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    sw = R.Sweep("panel", 0.5)
    cost = CostModel.load(R.DEFAULT_CALIBRATION, "llama-3-8b")
    row = R.Row("p", "panel", "gp_lvf-rotate_r3_k0.json", "lvf-rotate", 3.0, 0, 150, 100_000, "log", {}, {}, 0, 0, 0)
    (check,) = R.step_check([R.Panel("p", (sw,))], {("h200", "llama-3-8b"): cost}, [row])
    assert (check["rows"], check["kv_tokens"], check["measured_ms"], check["kv_peak"]) == (12.0, 40_000, 11.0, 0.7)
    assert check["model_ms"] == pytest.approx(1e3 * cost.decode_s(12, 40_000))
    assert check["kv_source"] == "pool use (upper bound)"
    (folder / "gp_server_lvf-rotate.log").write_text(  # a server that logs the rows' context: that, not the pool
        f"{step_profile.POINT_MARK} begins 3 0\n{line} of 2500 tokens\n{step_profile.POINT_MARK} ends 3 0\n")
    (check,) = R.step_check([R.Panel("p", (sw,))], {("h200", "llama-3-8b"): cost}, [row])
    assert check["kv_tokens"] == 30_000 and check["kv_source"] == "rows' context"
    assert check["model_ms"] == pytest.approx(1e3 * cost.decode_s(12, 30_000))
    (folder / "gp_server_lvf-rotate.log").write_text("no profile\n")
    assert R.step_check([R.Panel("p", (sw,))], {("h200", "llama-3-8b"): cost}, [row]) == []


def test_step_check_prices_each_logged_interval_at_its_own_rows(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A point whose intervals ran 2 rows and 50 rows: an MoE's step is concave in its rows, so the model
    prices each interval and weights by forwards, as the measured mean is; the price at the point's mean rows
    (which session 8's replay used) is kept beside it, and for Mixtral it is well above."""
    from bench import step_profile

    folder = tmp_path / "panel"
    folder.mkdir()

    def line(n: int, ms: float, rows: float, ctx: int) -> str:
        return ("[w0] INFO sglang_ext.worker.step_log: w0: steps 100 (50.0/s, 20.0 ms mean, 0 % with a prefill, "
                "100 % overlapped) | running 12.0 (remote 0.0) waiting 0.5 | rows 12.0 | tokens out 600/s, prefill "
                "0/s | executor wait 0.0 % (loads 0) | kv 40 % mean, 70 % peak | decode-only forwards "
                f"{n} x {ms} ms at {rows} rows of {ctx} tokens")

    (folder / "gp_server_fcfs-recompute.log").write_text("\n".join([
        f"{step_profile.POINT_MARK} begins 2 0", line(100, 12.0, 2.0, 6000), line(100, 34.0, 50.0, 6000),
        f"{step_profile.POINT_MARK} ends 2 0"]))
    (pt,) = step_profile.folder_points(folder)
    assert pt.decode_intervals == ((100, 12.0, 2.0, 6000.0, 1.0), (100, 34.0, 50.0, 6000.0, 1.0))
    assert (pt.decode_rows, pt.decode_ms) == (26.0, 23.0)
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    sw = R.Sweep("panel", 0.9, "mixtral-8x7b")
    cost = CostModel.load(R.DEFAULT_CALIBRATION, "mixtral-8x7b")
    row = R.Row("p", "panel", "gp_fcfs-recompute_r2_k0.json", "fcfs-recompute", 2.0, 0, 150, 300_000, "log", {}, {},
                0, 0, 0)
    (check,) = R.step_check([R.Panel("p", (sw,))], {("h200", "mixtral-8x7b"): cost}, [row])
    per = (cost.decode_s(2, 12_000) + cost.decode_s(50, 300_000)) / 2
    assert check["priced"] == "per interval" and check["model_ms"] == pytest.approx(1e3 * per)
    assert check["model_at_mean_ms"] == pytest.approx(1e3 * cost.decode_s(26, 26 * 6000))
    assert check["model_at_mean_ms"] > 1.1 * check["model_ms"]


def test_forwards_with_a_prefill_are_priced_per_interval() -> None:
    """The step check's prefill side: each interval's forwards with a prefill priced as one chunk of their mean
    tokens with the interval's decode rows beside it, weighted by forwards; none without such intervals."""
    from bench import step_profile

    cost = CostModel.load(R.DEFAULT_CALIBRATION, "mixtral-8x7b")
    pt = step_profile.PointSteps("fcfs-recompute", 2.0, 0, 2, 100, 50.0, 0.1, 20.0, 20.0, 0.0, 5000.0, 0.8, 1.0,
                                 90, 25.0, 20.0, 6000.0,
                                 prefill_intervals=((3, 400.0, 6000.0, 20.0, 6000.0, 1.0, 3000.5),
                                                    (1, 200.0, 2000.0, 10.0, 5000.0, 2.0, 3500.5)))
    c = R._prefill_check(cost, pt)
    # the second interval: two chunks of 1,000 tokens, each after a 3,000-token prefix (3,500.5 keys a token);
    # each forward also pays the plain loop's host time for its rows (decode rows + chunks)
    want = (3 * (cost.prefill_s([(6000, 6000)], 20, 120_000) + cost.plain_host_s(21))
            + cost.prefill_s([(1000, 4000)] * 2, 10, 50_000) + cost.plain_host_s(12)) / 4
    assert c["prefill_forwards"] == 4 and c["prefill_measured_ms"] == pytest.approx(350.0)
    assert c["prefill_tokens"] == pytest.approx(5000.0) and c["prefill_model_ms"] == pytest.approx(1e3 * want)
    assert c["prefill_keys"] == pytest.approx((3 * 3000.5 + 3500.5) / 4)
    # a prefix makes a chunk dearer than the same tokens from position 0
    assert cost.prefill_s([(1000, 4000)] * 2, 10, 50_000) > cost.prefill_s([(1000, 1000)] * 2, 10, 50_000)
    assert R._prefill_check(cost, step_profile.PointSteps("x", 1.0, 0, 1, 1, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.1, 0.1,
                                                          1, 1.0, 1.0)) == {}


def test_card_file_takes_a_card_of_the_chosen_panels(capsys: pytest.CaptureFixture[str]) -> None:
    assert R.main(["--panels", "qwen3", "--card-file", "h200"]) == 2
    assert "want GPU=JSON" in capsys.readouterr().err
    assert R.main(["--panels", "qwen3", "--card-file", "h300=x.json"]) == 2


def test_forwards_tally_splits_decode_only_from_prefill_forwards() -> None:
    """`--forwards`: the cost model's answers are unchanged, and each forward is counted once, decode-only
    (every row extends by one) apart from one with a prefill chunk."""
    cost = CostModel.load(R.DEFAULT_CALIBRATION, "llama-3-8b")
    tally = R.ForwardTally(cost)
    assert tally.forward_s([1, 1, 1], [100, 200, 300]) == cost.forward_s([1, 1, 1], [100, 200, 300])
    assert tally.forward_s([512, 1], [512, 400]) == cost.forward_s([512, 1], [512, 400])
    assert tally.kv_bytes_per_token == cost.kv_bytes_per_token  # everything else passes through
    assert [r for r, _ in tally.decode] == [3] and [(q[0], q[1]) for q in tally.prefill] == [(512, 1)]
    text = tally.text()
    assert text.startswith("forwards: 1 decode-only at 3.0 rows") and "1 with a prefill" in text
    assert "512 prefill tokens in 1.0 chunks, 256 keys a prompt token, 1.0 decode rows riding" in text
    # a chunk after a 1,000-token prefix: its tokens attend over it too (the count the step log makes)
    tally.forward_s([100, 1], [1100, 400])
    assert tally.prefill[-1][3:] == (1, 100 * 1000 + 100 * 101 // 2)


def test_decode_forwards_are_split_by_how_much_of_their_interval_ran_overlapped() -> None:
    """The step check separates intervals the overlap loop ran (almost) wholly plain from (almost) wholly
    overlapped ones: a plain decode's logged ms hold host time the model's forward does not (2026-12-07:
    13-21 % under in plain intervals, within 2.4 % in overlapped ones); mixed intervals go in neither."""
    intervals = [(100, 15.0, 10.0, 6000.0, 1.0), (50, 30.0, 20.0, 6000.0, 0.0), (10, 99.0, 20.0, 6000.0, 0.5),
                 (100, 17.0, 10.0, 6000.0, 0.95)]
    priced = [(100, 0.0150), (50, 0.0250), (10, 0.0250), (100, 0.0150)]
    got = R._by_overlap(intervals, priced)
    assert set(got) == {"overlapped", "plain"}
    assert got["overlapped"] == (200, pytest.approx(16.0), pytest.approx(15.0))
    assert got["plain"] == (50, pytest.approx(30.0), pytest.approx(25.0))


def test_expert_distribution_prices_a_panels_model_by_a_record(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--expert-distribution MODEL=JSON: a model of the chosen panels only; its decode experts then follow
    the record (bench/sim/expert_load.py)."""
    rec = tmp_path / "rec.json"
    rec.write_text(json.dumps({"logical_count": [[1000] * 8 + [67] * 120] * 48, "top_k": 8}))
    assert R.main(["--panels", "s14", "--expert-distribution", str(rec)]) == 2
    assert "want MODEL=JSON" in capsys.readouterr().err
    assert R.main(["--panels", "s14", "--expert-distribution", f"mixtral-8x7b={rec}"]) == 2
    assert R.main(["--panels", "s14", "--limit", "1", "--expert-distribution", f"qwen3-30b-a3b={rec}"]) == 0
    assert f"qwen3-30b-a3b: decode experts priced by the routing recorded in {rec}" in capsys.readouterr().out
