"""bench/scheduler_overhead.py on a small pool: the iterations that forwarded prompt tokens are timed apart
(a step the overlap loop runs plain, whose host time a GPU forward does not hide)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import scheduler_overhead as so


def test_prefill_steps_are_counted_and_timed_apart() -> None:
    a = argparse.Namespace(steps=40, warmup=5, queue=2, context=96, output=8, tokens=4096, budget_mb=16.0)
    r = so.run("rotate", "lvf", False, a)
    assert 0 < r["prefill_steps"] <= 40 and r["admitted"] > 0
    assert math.isfinite(r["prefill_step_us"]) and r["prefill_step_us"] > 0 and r["mean_us"] > 0
