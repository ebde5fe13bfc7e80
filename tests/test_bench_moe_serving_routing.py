"""bench/moe_serving_routing.py names an unknown preset as a usage error before building anything. The
routing count itself runs a real worker on the preset's geometry (about 30-100 s here): by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import moe_serving_routing as M


def test_an_unknown_preset_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        M.main(["--preset", "nope"])
    assert e.value.code == 2 and "unknown preset 'nope'" in capsys.readouterr().err


def test_a_malformed_range_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--prompt-len", "--vocab"):
        with pytest.raises(SystemExit) as e:
            M.main([flag, "4000"])
        assert e.value.code == 2 and "two integers, MIN,MAX" in capsys.readouterr().err
