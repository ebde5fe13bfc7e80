"""The engine's GPU-signalled exchange with flags lowered once per step (transport/gated.py), on real GPUs:
offload/peer.py's PeerRemote -- GatedSender and GatedProgram, as serving runs them -- with the executor on
the sender's GPU and on a second one. Each case runs tests/_gated_exchange_child.py in a process of its
own, killed if it hangs (a lost signal leaves a stream waiting forever), with every hardware queue the
driver offers (so that two streams of one GPU are less likely to share one; see test_gpu_cuda_signal.py):

- steps: consecutive steps, eager and replayed from CUDA graphs on both sides, with steps without remote
  rows between them, one at a time and queued back to back with no host synchronisation, give the
  attention of an eager reference executor; every flag is 0 after each group of steps;
- errors: the watchdog releases a sender whose executor never answers (eager and replayed steps queued),
  and a host drains the program of a sender that stopped mid-step;
- senders: two pairings on one executor, their steps in flight together, stay exact;
- capped: both again with the executor's programs confined to a green context of 16 SMs
  (`executor_max_sms`), each pairing's program on its own stream there.

The executor computes with FlashInfer (its graph lanes) or the torch backend (its eager program).
Skipped without CUDA, cuda-python or (for its cases) FlashInfer; the second-GPU cases with one GPU.
The same protocol is model-checked on the CPU in tests/test_gated_protocol.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_ext.transport import cuda_signal as cs

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
try:
    cs.driver()
except cs.CudaSignalError as e:
    pytest.skip(str(e), allow_module_level=True)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "tests" / "_gated_exchange_child.py"
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "CUDA_DEVICE_MAX_CONNECTIONS": "32"}
TIMEOUT_S = 420  # FlashInfer may compile its kernels on first use


def run_child(scenario: str, executor: str, backend: str, *extra: str) -> None:
    if executor != "cuda:0" and torch.cuda.device_count() < 2:
        pytest.skip("needs a second GPU")
    if backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("needs flashinfer (pip install flashinfer-python)")
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        r = subprocess.run([sys.executable, str(CHILD), scenario, executor, backend, *extra], env=env,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{scenario} hung (killed after {TIMEOUT_S} s; a signal was lost?); it got to:\n{out}")
    print(r.stdout)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), f"{r.stdout}\n{r.stderr[-4000:]}"


@pytest.mark.parametrize("backend", ["flashinfer", "torch"])
@pytest.mark.parametrize("executor", ["cuda:0", "cuda:1"])
def test_consecutive_steps_are_exact_and_leave_the_flags_down(executor: str, backend: str) -> None:
    run_child("steps", executor, backend)


@pytest.mark.parametrize("executor", ["cuda:0", "cuda:1"])
def test_watchdog_and_drain_release_a_broken_pairing(executor: str) -> None:
    run_child("errors", executor, "flashinfer" if importlib.util.find_spec("flashinfer") else "torch")


@pytest.mark.parametrize("executor", ["cuda:0", "cuda:1"])
def test_two_senders_on_one_executor_stay_exact(executor: str) -> None:
    run_child("senders", executor, "flashinfer" if importlib.util.find_spec("flashinfer") else "torch")


@pytest.mark.parametrize("scenario", ["steps", "senders"])
@pytest.mark.parametrize("executor", ["cuda:0", "cuda:1"])
def test_an_executor_capped_to_16_sms_stays_exact(executor: str, scenario: str) -> None:
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("needs flashinfer: the executor's green context is made with its green_ctx helpers")
    run_child(scenario, executor, "flashinfer", "16")
