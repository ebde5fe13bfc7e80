"""bench/remote_step.py's choice of executor GPU: the one-GPU form (the executor in-process on the sender's
own GPU, `samegpu` in bench/gpu_session.sh) needs a partition size and the plain transport, and says so
before touching a GPU. The timing itself runs on GPUs only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import remote_step


@pytest.mark.parametrize("extra, why", [
    ([], "needs --executor-gb"),
    (["--executor-device", "cpu"], "must be a GPU"),
    (["--executor-gb", "7", "--transport", "cuda_ipc"], "--transport local"),
    (["--executor-gb", "7", "--executor-load", "decode"], "--executor-load off"),
])
def test_the_same_gpu_form_names_what_it_needs(monkeypatch: pytest.MonkeyPatch, extra: list[str], why: str) -> None:
    monkeypatch.setattr(sys, "argv", ["remote_step.py", "--executor-device", "cuda:0", *extra])
    with pytest.raises(SystemExit, match=why):
        remote_step.main()


def test_without_enough_gpus_it_stops_with_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote_step.torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["remote_step.py", "--executor-device", "cuda:0", "--executor-gb", "7"])
    with pytest.raises(SystemExit, match="needs a GPU"):
        remote_step.main()
    monkeypatch.setattr(sys, "argv", ["remote_step.py"])
    with pytest.raises(SystemExit, match="needs two GPUs"):
        remote_step.main()
