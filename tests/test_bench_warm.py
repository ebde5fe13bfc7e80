"""bench/warm.py (gpu_session.sh's `warm`): it must reach every prefill length bucket up to the chunk
size, so no MoE kernel config compiles inside a timed point. The script itself runs here on the
embedded default model; compiling anything happens on a GPU only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import warm


def test_prompt_lengths_double_up_to_the_chunk() -> None:
    got = warm.prompt_lengths(8192)
    assert got[:4] == [1, 2, 4, 8]
    assert got[-2:] == [4096, 8184]
    assert got == sorted(set(got))  # increasing, no repeats


def test_warm_runs_every_length_and_a_batch_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert warm.main(["--model", "", "--device", "cpu", "--chunk", "32", "--batch", "3"]) == 0
    out = capsys.readouterr().out
    for n in warm.prompt_lengths(32):
        assert f"prefill {n:>5} tokens" in out
    assert "batch of 3 short prompts" in out and "warm: done" in out


def test_server_args_reach_the_engine_as_keywords() -> None:
    """The runs' launcher flags (gpu_session.sh's SERVER_ARGS) warm the kernels those flags select."""
    assert warm.server_kwargs([]) == {}
    assert warm.server_kwargs(["--moe-routing-simulation=uniform"]) == {"moe_routing_simulation": "uniform"}
    assert warm.server_kwargs(["--moe-routing-simulation", "uniform", "--chunked-prefill-size", "4096"]) == {
        "moe_routing_simulation": "uniform", "chunked_prefill_size": 4096}
    with pytest.raises(SystemExit):  # a flag the launcher does not know is an error, not ignored
        warm.server_kwargs(["--no-such-flag"])


def test_warm_passes_server_args_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert warm.main(["--model", "", "--device", "cpu", "--chunk", "16", "--batch", "2",
                      "--server-arg=--chunked-prefill-size", "--server-arg=16"]) == 0
    assert "warm: done" in capsys.readouterr().out
