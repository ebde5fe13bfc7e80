"""bench/decode_from_reports.py: a decode step's cost from a goodput point's client reports (the bound and
the estimate its docstring defines), and bad input as usage errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import decode_from_reports as D


def _report(folder: Path) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "gp_fcfs-recompute_r2_k0.json").write_text(json.dumps({
        "metrics": {"concurrency": 10.0, "itl_ms": {"p99": 200.0}, "total_output_tokens": 30_000,
                    "duration_s": 80.0, "completed": 100, "tpot_ms": {"mean": 30.0}},
        "workload": {"mean_output_len": 300.0, "mean_input_len": 5000.0}}))


def test_bound_estimate_and_roofline(tmp_path: Path) -> None:
    _report(tmp_path)
    (x,) = D.folder_points(tmp_path, None, None)
    # bound: (80 - 100 x 0.2) s over 30,000 / 10 steps = 20 ms; estimate: 30 ms - 10 x 0.2 s / 300 = 23.3 ms
    assert (x.run, x.rate, x.repeat) == ("fcfs-recompute", 2.0, 0)
    assert x.bound_ms == pytest.approx(20.0) and x.estimate_ms == pytest.approx(30.0 - 2000.0 / 300)
    assert x.roofline_ms is None and x.server == ""
    (y,) = D.folder_points(tmp_path, "preset:qwen3-30b-a3b", 3.0)
    from bench.sim.geometry import Geometry

    geo = Geometry.preset("qwen3-30b-a3b")
    read = geo.weight_read_bytes(10.0) + 10.0 * 5150.0 * geo.kv_bytes_per_token
    assert y.roofline_ms == pytest.approx(1e3 * read / 3e12)


def test_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert D.main([str(tmp_path)]) == 1 and "no goodput reports" in capsys.readouterr().err
    _report(tmp_path)
    with pytest.raises(SystemExit) as e:
        D.main([str(tmp_path), "--hbm-from", str(tmp_path / "missing.json")])
    assert e.value.code == 2 and "hbm_read_TBps" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        D.main([str(tmp_path), "--model", "preset:nope"])
    assert e.value.code == 2 and "nope" in capsys.readouterr().err
