"""A calibration derived by datasheet ratios (bench/sim/derive.py): what it scales, what it keeps, that the
committed h100 file is what the command writes, and that the H100 run is priced with it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.sim import derive as D
from bench.sim import replay_sweeps as R
from bench.sim.cost import CALIBRATION_DIR, Calibration, CostModel
from bench.sim.instance import gpu_calibration, known_gpus

H200 = json.loads((CALIBRATION_DIR / "h200.json").read_text())
H100_REPORT = R.RESULTS / "2026-12-06-h100-s3/knee-share05-ttft5/gp_lvf-rotate_r5_k2.json"


def test_memory_rates_scale_by_the_hbm_ratio_and_the_rest_is_kept() -> None:
    out = D.derive(H200, "h200", "h100", "h200.json", "cmd")
    mem = 3.35 / 4.8
    for section, key in D.MEMORY_RATES:
        assert out[section][key] == pytest.approx(H200[section][key] * mem)
    for section, key in D.COMPUTE_RATES:  # same chip, same bf16 peak
        assert out[section][key] == pytest.approx(H200[section][key])
    for key in ("row_us", "step_us"):
        assert out["decode"][key] == H200["decode"][key]
    for section in ("host_link", "remote_exchange", "executor_host", "loop"):
        assert out[section] == H200[section]
    assert "hbm_read_GBps_measured" not in out["decode"]  # not measured on the derived GPU
    assert out["decode"]["hbm_read_GBps_derived"] == pytest.approx(H200["decode"]["hbm_read_GBps_measured"] * mem)
    assert out["gpu"] == "NVIDIA H100 80GB HBM3" and "NOT profiled" in out["derived"]["note"]
    assert "derived" in out["missing"]
    cal = Calibration.from_dict(out)  # loads like a fitted file
    c100, c200 = CostModel(cal, CostModel.load().geo), CostModel.load()
    assert c100.decode_s(64, 64 * 2048) > c200.decode_s(64, 64 * 2048)  # a memory-bound step is slower


def test_a_different_host_link_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(D.DATASHEETS, "gh200", replace(D.DATASHEETS["h200"], host_link="NVLink-C2C"))
    with pytest.raises(ValueError, match="different links"):
        D.derive(H200, "h200", "gh200", "h200.json", "cmd")


def test_the_committed_h100_file_is_what_the_command_writes(tmp_path: Path) -> None:
    out = tmp_path / "h100.json"
    assert D.main(["--from", "h200", "--to", "h100", "--out", str(out)]) == 0
    fresh, committed = json.loads(out.read_text()), json.loads((CALIBRATION_DIR / "h100.json").read_text())
    for d in (fresh, committed):
        d.pop("derived_at"), d.pop("command"), d["derived"].pop("from")
    redo = "python -m bench.sim.derive --from h200 --to h100 --out bench/sim/calibration/h100.json"
    assert fresh == committed, f"h200.json changed since h100.json was derived: {redo}"


def test_a_derived_file_is_not_derived_again(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        D.main(["--from", "h100", "--to", "h200", "--calibration", str(CALIBRATION_DIR / "h100.json"),
                "--out", str(tmp_path / "x.json")])


def test_h100_is_a_known_gpu_with_its_driver_memory() -> None:
    assert {"h100", "h200"} <= set(known_gpus())
    path, mem = gpu_calibration("h100")
    assert path.name == "h100.json" and mem == pytest.approx(81_559 / 1024)


def test_the_h100_panel_is_priced_on_the_h100_file() -> None:
    panel = next(pn for pn in R.PANELS if "h100" in pn.name)
    (sw,) = panel.sweeps
    assert (sw.gpu, sw.share, sw.model) == ("h100", 0.5, "llama-3-8b")
    tokens, source = R.pool_tokens(H100_REPORT, "lvf-rotate", sw, (0.0, 0.0))  # the log, not the H200 math
    assert tokens == (12291 - 1) * 16 and source == "server log (12291 pages)"
    with pytest.raises(ValueError, match="H200 pools only"):
        R.pool_tokens(H100_REPORT.parent / "calls" / "none.json", "lvf-rotate", sw, (0.0, 0.0))
    report = json.loads(H100_REPORT.read_text())
    report["config"]["num_requests"] = 12  # a fast smoke
    pred = R.predict(report, "lvf-rotate", tokens, sw, CostModel.load(gpu_calibration("h100")[0]))
    assert pred["scheduled"] == 12 and 0.0 <= pred["both"] <= 1.0 and pred["tpot_mean_ms"] > 0


def test_the_plan_command_on_an_h100_says_its_calibration_is_derived(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from bench.sim import plan as plan_cmd

    example = Path(__file__).resolve().parents[1] / "bench/sim/examples/models.yaml"
    out = tmp_path / "plan.json"
    rc = plan_cmd.main(["--models", str(example), "--gpu", "h100", "--traffic", "servegen", "--total-rate", "3",
                        "--seconds", "3", "--strategy", "dedicated", "--scales", "1", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "SIMULATED on NVIDIA H100 80GB HBM3 (80 GiB)" in text and "DERIVED calibration" in text
    assert "DERIVED" in json.loads(out.read_text())["error_band"]


def test_validate_prices_a_cards_own_runs_with_its_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`validate --calibration h100.json` takes only H100 reports (none yet: it says so), every one of them
    held out (the file was never fitted there), and leaves out the H200's executor-host measurements."""
    from bench.sim import validate as V

    h100 = CALIBRATION_DIR / "h100.json"
    assert V.card("NVIDIA H100 80GB HBM3") == "H100" and V.card("NVIDIA H200") == "H200"
    assert V.main(["--calibration", str(h100), "--results", str(tmp_path), "--out", str(tmp_path / "v.json")]) == 0
    assert "no step time measured on NVIDIA H100 80GB HBM3" in capsys.readouterr().out
    src = json.loads((R.RESULTS / "2026-12-03-h200-s4/c2-moebench-bench/offline.json").read_text())
    src["env"]["gpu"] = "NVIDIA H100 80GB HBM3"  # as if the same bench had run on an H100
    (tmp_path / "offline.json").write_text(json.dumps(src))
    res = V.validate(h100, tmp_path)
    sets = {r["set"] for r in res["rows"]}
    assert sets == {"held-out"} and len(res["rows"]) >= len(src["decode"])
    # the H100 file prices the same step slower than the H200's (its HBM is slower)
    h200 = V.validate(CALIBRATION_DIR / "h200.json", R.RESULTS)
    row = res["rows"][0]
    same = next(r for r in h200["rows"] if r["point"] == row["point"] and r["what"] == row["what"])
    assert row["predicted_ms"] > same["predicted_ms"]


def test_the_derived_file_prices_qwen3_decode_timed_on_an_h100_within_5_percent() -> None:
    """The step times measured on an H100 (2026-12-06 s4, c4: Qwen3-30B-A3B decode at bs 8 and 32, ctx 4K;
    2026-12-07 s11: bs 1-32 at ctx 1K and 4K under uniform routing; s12: bs 12 and 24) against the derived
    file: every decode row at a CUDA-graph size within 5 % (-4.1 to +4.7 %). Its MoE serving misses
    (docs/simulator.md); this is the check that the decode step is not why. (s11's batched prefill,
    4 x 2,048, reads +6.4 %: not a decode row.)

    The known miss, and its fix: before commit 2e5bb7a (session 13) a batch between graph sizes ran padded
    (12 -> 16 rows) with the padding rows routed to experts, and cost nearly the padded size's step (bs 12
    measured 2.4 / 4.6 % under bs 16), while the cost model prices the experts that 12 rows hit: -10.1 /
    -9.2 % at ctx 1K / 4K (session 12's rows). Since, padding rows reach no expert
    (tests/test_moe_padding_rows.py), and the same points measured again (session 14: bs 12 and 20, graphs
    16 and 24) are priced within 1 %, as every row at a graph size."""
    from bench.sim import validate as V
    from sglang_ext.engine.cuda_graph import capture_sizes

    res = V.validate(CALIBRATION_DIR / "h100.json", R.RESULTS)
    # session 12's bs-12 rows are outliers since session 15 (fit.MOE_OUTLIERS: measured before the fix)
    rows = [r for r in res["rows"] if r["set"] in ("moe-held-out", "moe-outlier")
            and "qwen3" in r["point"] and r["what"].startswith("decode")]
    assert len(rows) >= 16 and all("H100" in res["gpu"] for _ in rows)
    graph = set(capture_sizes(256))

    def bs(r: dict) -> int:
        return int(r["point"].split(" bs ")[1].split()[0])

    def before_fix(r: dict) -> bool:  # measured by an engine that routed padding rows to experts
        env = json.loads((R.RESULTS.parents[1] / r["source"]).read_text())["env"]
        return str(env["date"]) < "2026-12-07T09:15"  # commit 2e5bb7a

    on_graph = [r for r in rows if bs(r) in graph]
    padded = [r for r in rows if bs(r) not in graph and before_fix(r)]
    fixed = [r for r in rows if bs(r) not in graph and not before_fix(r)]
    assert len(on_graph) >= 14 and all(abs(r["err_pct"]) < 5.0 for r in on_graph), on_graph
    assert padded and all(-12.0 < r["err_pct"] < -7.0 for r in padded), padded
    assert {r["set"] for r in padded} == {"moe-outlier"} and all(r["set"] == "moe-held-out" for r in on_graph + fixed)
    assert len(fixed) >= 4 and all(abs(r["err_pct"]) < 2.0 for r in fixed), fixed
    # the explanation, priced: the padded graph's experts (and the real rows' attention) within 3 %
    then = CostModel.load(CALIBRATION_DIR / "h100.json", "qwen3-30b-a3b", capture_sizes(256))
    for r in padded:
        ctx = int(r["point"].split(" ctx ")[1].split()[0])
        assert abs(1e3 * then.decode_s(bs(r), bs(r) * ctx) / r["measured_ms"] - 1) < 0.03, r
