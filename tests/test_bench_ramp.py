"""bench/serving.py's `--arrival ramp` (a Poisson process following a ServeGen model's rate series) and
the per-model SLO-attainment timeline."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.metrics import RequestResult, SloConfig, slo_timeline
from bench.traces import ramp_arrivals, servegen_rate_series


def test_arrivals_follow_the_rates_and_peak_at_the_asked_rate() -> None:
    rates = [1.0, 4.0, 2.0]  # scaled so the busiest window runs at 40 req/s
    a = ramp_arrivals(6000, rates, 40.0, 10.0, 1.0, np.random.default_rng(0))
    assert a[0] == 0.0 and a == sorted(a)
    per_window = np.bincount([int(t // 10) for t in a])
    # expected 100, 400, 200 per 10 s window, repeating
    for i, want in enumerate([100, 400, 200, 100, 400, 200]):
        assert abs(per_window[i] - want) < 4 * want**0.5, (i, per_window[i], want)


def test_a_zero_rate_window_gets_no_arrivals() -> None:
    a = ramp_arrivals(500, [2.0, 0.0, 2.0], 10.0, 5.0, 1.0, np.random.default_rng(1))
    assert not any(5.0 < t < 10.0 for t in a)


def test_bad_ramps_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ramp_arrivals(10, [1.0], float("inf"), 10.0, 1.0, np.random.default_rng(0))
    f = tmp_path / "rates.csv"
    f.write_text("category,model,window_start_s,total_rate_rps\nlanguage,a,0,5\nlanguage,a,600,10\n")
    assert servegen_rate_series(f, "a", 0, 2) == ("a", [5.0, 10.0])
    with pytest.raises(ValueError, match="needed"):
        servegen_rate_series(f, "a", 1, 2)
    with pytest.raises(ValueError, match="no ServeGen model"):
        servegen_rate_series(f, "b", 0, 1)


def test_slo_timeline_per_model() -> None:
    def r(t: float, model: str, ttft: float) -> RequestResult:
        return RequestResult(0, model, 10, 4, t, success=True, ttft_s=ttft, e2e_s=ttft + 0.1, output_tokens=4,
                             itls_s=[0.01] * 3)

    res = [r(0.5, "hot", 0.1), r(0.7, "hot", 5.0), r(1.5, "cold", 0.1)]
    tl = slo_timeline(res, 2.0, SloConfig(ttft_s=1.0, tbt_s=0.1, tbt_stat="mean"), bin_s=1.0)
    assert tl["t_s"] == [0.0, 1.0]
    assert tl["hot"] == {"requests": [2, 0], "attainment": [0.5, None]}
    assert tl["cold"] == {"requests": [0, 1], "attainment": [None, 1.0]}
    assert tl["all"] == {"requests": [2, 1], "attainment": [0.5, 1.0]}


def test_plot_slo_timeline(tmp_path: Path) -> None:
    import json

    from bench.plot_slo_timeline import main

    tl = {"bin_s": 1.0, "t_s": [0.0, 1.0], "all": {"requests": [2, 1], "attainment": [0.5, 1.0]},
          "hot": {"requests": [2, 0], "attainment": [0.5, None]}}
    (tmp_path / "a.json").write_text(json.dumps({"slo_timeline": tl}))
    main([f"fixed={tmp_path / 'a.json'}", f"adaptive={tmp_path / 'a.json'}", "--out", str(tmp_path / "p.png")])
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_burst_arrivals_keep_the_mean_rate_and_crowd_the_bursts() -> None:
    from bench.traces import burst_arrivals

    a = np.asarray(burst_arrivals(9000, 6.0, 4.0, 5.0, 30.0, 1.0, np.random.default_rng(2)))
    assert abs(len(a) / a[-1] - 6.0) < 0.3  # the stated mean rate
    in_burst = (a % 30.0) < 5.0  # 1/6 of the time at 4x the quiet rate: 4/9 of the arrivals
    assert abs(in_burst.mean() - 4 / 9) < 0.03
    with pytest.raises(ValueError, match="multiple"):
        burst_arrivals(10, 6.0, 4.0, 7.0, 30.0, 1.0, np.random.default_rng(0))
