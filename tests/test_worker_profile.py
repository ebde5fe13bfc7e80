"""The worker's profiler window (`SGLANG_EXT_PROFILE=START:STEPS:DIR`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_ext.worker.profile import StepProfiler, window_from_env


def test_the_window_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SGLANG_EXT_PROFILE", raising=False)
    assert window_from_env() is None
    monkeypatch.setenv("SGLANG_EXT_PROFILE", f"100:20:{tmp_path}")
    assert window_from_env() == (100, 20, tmp_path)
    for bad in ("100:20", "x:20:/tmp", "5:0:/tmp", "-1:3:/tmp"):
        monkeypatch.setenv("SGLANG_EXT_PROFILE", bad)
        assert window_from_env() is None


def test_profiles_the_steps_of_the_window_once(tmp_path: Path) -> None:
    p = StepProfiler(2, 3, tmp_path, "w0", cuda=False)
    x = torch.randn(64, 64)
    for step in range(8):
        p.before_step()
        assert (p._prof is not None) == (2 <= step < 5)
        torch.mm(x, x)
        p.after_step()
    assert p.done
    text = (tmp_path / "w0.txt").read_text()
    assert "steps 2..4" in text and "aten::mm" in text and "by self CPU time" in text
    assert (tmp_path / "w0.trace.json").stat().st_size > 0
