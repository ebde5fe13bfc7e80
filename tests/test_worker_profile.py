"""The worker's profiler window (`--profile-dir DIR --profile-start-step START --profile-num-steps STEPS`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from sglang_ext.server_args import ServerArgs
from sglang_ext.worker.profile import StepProfiler, make_profiler


def test_the_window_from_the_arguments(tmp_path: Path) -> None:
    assert make_profiler(ServerArgs(), "w0", cuda=False) is None  # off by default
    p = make_profiler(ServerArgs(profile_dir=str(tmp_path), profile_start_step=100, profile_num_steps=20), "w0",
                      cuda=False)
    assert p is not None and (p.start, p.steps, p.out, p.name, p.cuda) == (100, 20, tmp_path, "w0", False)
    d = make_profiler(ServerArgs(profile_dir=str(tmp_path)), "w0", cuda=False)
    assert d is not None and (d.start, d.steps) == (0, 10)


@pytest.mark.parametrize(("kw", "match"), [
    ({"profile_start_step": 5}, "profile_dir is not"),
    ({"profile_num_steps": 3}, "profile_dir is not"),
    ({"profile_dir": ""}, "profile_dir must name"),
    ({"profile_dir": "/tmp/p", "profile_num_steps": 0}, "profile_num_steps must be >= 1"),
    ({"profile_dir": "/tmp/p", "profile_start_step": -1}, "profile_start_step must be >= 0"),
])
def test_a_bad_window_is_an_error(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kw)  # type: ignore[arg-type]


def test_profiles_the_steps_of_the_window_once(tmp_path: Path) -> None:
    p = StepProfiler(tmp_path, "w0", cuda=False, start=2, steps=3)
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


def test_a_preset_worker_id_makes_plain_file_names(tmp_path: Path) -> None:
    """`preset:NAME-0` (a worker of --model-path preset:NAME) writes preset_NAME-0.txt: no ':' in a file name."""
    p = StepProfiler(tmp_path, "preset:llama-3-8b-0", cuda=False, steps=1)
    p.before_step()
    p.after_step()
    assert p.done and (tmp_path / "preset_llama-3-8b-0.txt").exists()
    assert not list(tmp_path.glob("*:*"))


def test_a_worker_logs_and_profiles_its_steps_when_asked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from sglang_ext.messages import GenerateReq
    from sglang_ext.sampling.params import SamplingParams
    from sglang_ext.worker.worker import Worker

    args = ServerArgs(device="cpu", dtype="float32", max_total_tokens=256, skip_tokenizer_init=True,
                      step_log_interval_s=1e-9, profile_dir=str(tmp_path), profile_start_step=1,
                      profile_num_steps=2)
    w = Worker(args, "w7")
    assert w.step_log is not None and w.profiler is not None
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    inbox = [GenerateReq(rid="r0", input_ids=list(range(10, 20)), sampling_params=sp)]
    with caplog.at_level(logging.INFO, logger="sglang_ext.worker"):
        for _ in range(50):
            w.step(inbox)
            inbox = []
            if not w.has_work():
                break
    assert any(m.startswith("w7: steps 1 (") for m in caplog.messages)  # a line per step at this interval
    assert w.profiler.done and "steps 1..2" in (tmp_path / "w7.txt").read_text()
    assert (tmp_path / "w7.trace.json").stat().st_size > 0
    plain = Worker(ServerArgs(device="cpu", dtype="float32", max_total_tokens=256, skip_tokenizer_init=True), "w8")
    assert plain.step_log is None and plain.profiler is None
