"""GPU-signalled exchange primitives (sglang_ext/transport/cuda_signal.py) on real GPUs: a stream that waits
on a flag sees the data its producer wrote before setting it (one GPU, two GPUs, eager and replayed from
CUDA graphs with reset-after-consume flags), `peer_copy` moves bytes between GPUs, and a second process
writes into a buffer it mapped with CUDA IPC. Every producer sleeps ~0.1 s before writing, so a consumer
that did not really wait would read the old bytes. In one process the producer is queued first: two
streams of one GPU can share a hardware queue, and a wait queued ahead of its writer there would never
end. Skipped without CUDA or cuda-python; the two-GPU cases without a second GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _cuda_ipc_child import pattern

from sglang_ext.transport import cuda_signal as cs
from sglang_ext.transport.protocol import IPC_HANDLE_BYTES, IpcHandle

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
try:
    cs.driver()
except cs.CudaSignalError as e:
    pytest.skip(str(e), allow_module_level=True)

pytestmark = pytest.mark.gpu
SLEEP_CYCLES = 200_000_000  # ~0.1 s on an H200
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ROOT = Path(__file__).resolve().parent.parent


def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    cs.enable_peer_access(0, 1)
    cs.enable_peer_access(1, 0)


def finish(*streams: torch.cuda.Stream, flags: cs.FlagArray | None = None, timeout: float = 20.0) -> None:
    """Wait for the streams; if a flag wait is never satisfied, force the flags to 1 (so the stuck stream
    does not hang later tests) and fail."""
    events = []
    for s in streams:
        e = torch.cuda.Event()
        e.record(s)
        events.append(e)
    deadline = time.monotonic() + timeout
    while not all(e.query() for e in events):
        if time.monotonic() > deadline:
            if flags is not None:
                flags.fill(torch.cuda.Stream(device=flags.device), 1)
            pytest.fail("streams did not finish: a flag wait was never satisfied")
        time.sleep(0.001)


def rand_bytes(n: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def produce(stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor, flags: cs.FlagArray) -> None:
    """Sleep, copy src -> dst with a raw copy, then set flag 0."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    cs.peer_copy(dst.data_ptr(), src.data_ptr(), src.numel(), stream)
    flags.write(stream, 0, 1)


def consume(stream: torch.cuda.Stream, out: torch.Tensor, buf: torch.Tensor, flags: cs.FlagArray) -> None:
    """Wait for flag 0, reset it (reset-after-consume), then copy buf -> out with a torch kernel."""
    flags.wait(stream, 0, 1)
    flags.write(stream, 0, 0)
    with torch.cuda.stream(stream):
        out.copy_(buf)


@pytest.mark.parametrize("consumer_device", [0, 1])
def test_flag_orders_a_consumer_after_its_producer(consumer_device: int) -> None:
    if consumer_device == 1:
        two_gpus()  # producer on GPU 0 pushes into GPU 1 and sets GPU 1's flag
    n = 1 << 20
    cons = f"cuda:{consumer_device}"
    src, buf = rand_bytes(n, "cuda:0", 1), torch.zeros(n, dtype=torch.uint8, device=cons)
    out = torch.zeros_like(buf)
    flags = cs.FlagArray.allocate(1, consumer_device)
    ps, qs = torch.cuda.Stream(device=0), torch.cuda.Stream(device=consumer_device)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(consumer_device)
    produce(ps, buf, src, flags)  # sleeps first: a consumer that did not wait would copy zeros
    consume(qs, out, buf, flags)
    finish(ps, qs, flags=flags)
    assert torch.equal(out.cpu(), src.cpu())
    assert flags.read() == [0]


def test_graph_replays_reuse_reset_flags() -> None:
    """Both sides captured once; each replay moves fresh data: the flag values baked at capture work
    every time because the consumer zeroes the flag it consumed."""
    n = 1 << 16
    src, buf = rand_bytes(n, "cuda:0", 2), torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    out = torch.zeros_like(buf)
    flags = cs.FlagArray.allocate(1, 0)
    ps, qs = torch.cuda.Stream(device=0), torch.cuda.Stream(device=0)
    gp, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(gc, stream=qs):
        consume(qs, out, buf, flags)
    with torch.cuda.graph(gp, stream=ps):
        produce(ps, buf, src, flags)
    for seed in (3, 4, 5):
        with torch.cuda.stream(ps):
            src.copy_(rand_bytes(n, "cuda:0", seed))
        ps.synchronize()
        with torch.cuda.stream(ps):
            gp.replay()
        with torch.cuda.stream(qs):
            gc.replay()
        finish(ps, qs, flags=flags)
        assert torch.equal(out.cpu(), src.cpu()), f"replay with seed {seed}"
        assert flags.read() == [0]


@pytest.mark.parametrize("issuer", ["source", "destination"])
def test_peer_copy_moves_bytes_between_gpus(issuer: str) -> None:
    two_gpus()
    n = (1 << 20) + 12  # not a multiple of any copy granule
    src, dst = rand_bytes(n, "cuda:0", 6), torch.zeros(n, dtype=torch.uint8, device="cuda:1")
    s = torch.cuda.Stream(device=0 if issuer == "source" else 1)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    cs.peer_copy(dst.data_ptr(), src.data_ptr(), n, s)
    finish(s)
    assert torch.equal(dst.cpu(), src.cpu())


def test_ipc_handle_bytes_round_trip() -> None:
    t = torch.zeros(1000, dtype=torch.uint8, device="cuda:0")
    h = cs.export_tensor(t[8:])
    assert len(h.handle) == IPC_HANDLE_BYTES and h.nbytes == 992
    assert IpcHandle.from_bytes(h.to_bytes()) == h
    with pytest.raises(ValueError, match="80 bytes"):
        IpcHandle.from_bytes(h.to_bytes()[:-1])


@pytest.mark.parametrize("child_device", [0, 1])
def test_second_process_writes_into_ipc_mapped_buffer(child_device: int) -> None:
    if child_device == 1:
        two_gpus()
    n = (1 << 20) + 64
    buf = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    out = torch.zeros_like(buf)
    flags = cs.FlagArray.allocate(1, 0)
    qs = torch.cuda.Stream(device=0)
    torch.cuda.synchronize(0)
    consume(qs, out, buf, flags)  # waits for the child's flag write, through its mapping
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [str(child_device), "0", str(n), cs.export_tensor(buf).to_bytes().hex(), flags.export().to_bytes().hex()]
    try:
        r = subprocess.run([sys.executable, str(ROOT / "tests" / "_cuda_ipc_child.py"), *args], env=env,
                           capture_output=True, text=True, timeout=120)
        failure = "" if r.returncode == 0 and r.stdout.strip() == "ok" else r.stderr[-3000:]
    except subprocess.TimeoutExpired:
        failure = "child timed out"
    if failure:
        flags.fill(torch.cuda.Stream(device=0), 1)  # unblock the consumer before failing
        finish(qs)
        pytest.fail(failure)
    finish(qs, flags=flags)
    assert torch.equal(out.cpu(), pattern(n, "cpu"))
    assert flags.read() == [0]
