"""DuplexRotationEngine on a GPU (Llama-3-8B page geometry, 2 MiB pages), its methods and the benchmark's
variants of it (bench/rotation_variants.py): each moves scattered pages bit-exactly both ways; a swap-out
and a swap-in run at once without waiting for each other; a swap-out is ordered after compute queued
before it and a swap-in after compute still reading its pages; `done` and `fence` mean what rotation.py
says; no call blocks the host (torch's sync debug mode, and the calls return while the GPU is asleep);
NUMA-placed, registered host memory works as the host pool.
Waits use a ~0.25 s sleep kernel, so a copy that did not really wait would see the old bytes.
Skipped without CUDA."""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rotation_variants import ALL_METHODS, make_engine
from sglang_ext.kvcache import host_memory, memcpy_batch
from sglang_ext.kvcache.duplex import DuplexRotationEngine
from sglang_ext.kvcache.host_pool import HostKVPool
from sglang_ext.kvcache.pool import KVGeometry, KVPool

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu
GEOM = KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
PAGES = 64  # 128 MiB each side
SLEEP_CYCLES = 500_000_000  # ~0.25 s on an H200


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # compare bytes, not bf16 values


def make(method: str, staging_pages: int = 4) -> tuple[DuplexRotationEngine, KVPool, HostKVPool]:
    pool = KVPool(GEOM, PAGES, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    pool.data.copy_(torch.randn(pool.data.shape, device="cuda", generator=g).to(torch.bfloat16))
    host = HostKVPool(GEOM, PAGES, pin=True)
    eng = make_engine(method, pool, host, staging_bytes=staging_pages * GEOM.page_bytes)
    torch.cuda.synchronize()
    return eng, pool, host


def batched_or_skip(eng: DuplexRotationEngine) -> None:
    if eng.requested_method == "batched" and eng.method != "batched":
        try:
            memcpy_batch.load()
        except memcpy_batch.BatchCopyUnavailable as e:
            pytest.skip(f"cudaMemcpyBatchAsync unavailable: {e}")
        pytest.fail(f"batched copies fell back: {eng.fallback_reason}")


@contextmanager
def no_sync_allowed() -> Iterator[None]:
    """torch raises on any synchronizing call inside."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_every_method_round_trips_scattered_pages(method: str) -> None:
    eng, pool, host = make(method)
    rng = random.Random(3)
    dev = rng.sample(range(1, PAGES), 40)
    hst = rng.sample(range(1, PAGES), 40)
    before = pool.data.cpu()
    t = eng.swap_out(dev, hst)
    eng.synchronize()
    batched_or_skip(eng)
    assert eng.done(t)
    for d, h in zip(dev, hst, strict=True):
        assert torch.equal(bits(host.data[h]), bits(before[d])), (method, d, h)
    back = rng.sample(range(1, PAGES), 40)
    pool.data[back] = 0
    t = eng.swap_in(hst, back)
    eng.synchronize()
    assert eng.done(t)
    after = pool.data.cpu()
    for d, b in zip(dev, back, strict=True):
        assert torch.equal(bits(after[b]), bits(before[d])), (method, d, b)
    untouched = [p for p in range(PAGES) if p not in back]
    assert torch.equal(bits(after[untouched]), bits(before[untouched]))


@pytest.mark.parametrize("method", ALL_METHODS)
def test_duplex_out_and_in_at_once(method: str) -> None:
    eng, pool, host = make(method)
    host.data[30:50] = torch.full((20, *host.data.shape[1:]), 5.0, dtype=torch.bfloat16)
    before = pool.data.cpu()
    out_dev, out_host = list(range(1, 21)), list(range(1, 21))
    in_host, in_dev = list(range(30, 50)), list(range(50, 30, -1))
    # Hold the out stream: the swap-in must not queue behind the swap-out.
    assert eng.out_stream is not None
    with torch.cuda.stream(eng.out_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    t_out = eng.swap_out(out_dev, out_host)
    t_in = eng.swap_in(in_host, in_dev)
    deadline = time.monotonic() + 10.0
    while not eng.done(t_in):
        assert time.monotonic() < deadline, "swap-in did not finish while the swap-out was held"
        time.sleep(0.001)
    assert not eng.done(t_out), "the held swap-out finished first: the streams are not independent"
    eng.synchronize()
    batched_or_skip(eng)
    assert eng.done(t_out)
    for d, h in zip(out_dev, out_host, strict=True):
        assert torch.equal(bits(host.data[h]), bits(before[d]))
    assert bool((pool.data[in_dev] == 5.0).all())


@pytest.mark.parametrize("method", ALL_METHODS)
def test_swap_out_waits_for_compute_queued_before_it(method: str) -> None:
    eng, pool, host = make(method)
    torch.cuda._sleep(SLEEP_CYCLES)  # on the compute (current) stream
    pool.data[7].fill_(7.0)  # the step that writes the page, still queued behind the sleep
    t = eng.swap_out([7], [9])
    assert not eng.done(t)  # the GPU is asleep: the copy cannot have run
    eng.synchronize()
    assert eng.done(t)
    assert bool((host.data[9] == 7.0).all())


@pytest.mark.parametrize("method", ALL_METHODS)
def test_swap_in_waits_for_compute_still_reading_its_pages(method: str) -> None:
    eng, pool, host = make(method)
    old = pool.data[11].clone()
    host.data[3].fill_(3.0)
    torch.cuda._sleep(SLEEP_CYCLES)
    read = pool.data[11].clone()  # a step in flight reading the page's previous contents
    t = eng.swap_in([3], [11])
    eng.synchronize()
    torch.cuda.synchronize()
    assert eng.done(t)
    assert torch.equal(bits(read), bits(old))
    assert bool((pool.data[11] == 3.0).all())


@pytest.mark.parametrize("method", ALL_METHODS)
def test_fence_orders_the_compute_stream_after_a_swap_in(method: str) -> None:
    eng, pool, host = make(method)
    host.data[5].fill_(5.0)
    assert eng.in_stream is not None
    with torch.cuda.stream(eng.in_stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # a slow link
    t = eng.swap_in([5], [13])
    assert not eng.done(t)
    eng.fence(t)
    seen = pool.data[13].clone()  # the next step's read, on the compute stream
    torch.cuda.synchronize()
    assert eng.done(t)
    assert bool((seen == 5.0).all())


@pytest.mark.parametrize("method", ALL_METHODS)
def test_no_call_blocks_the_host(method: str) -> None:
    eng, _, _ = make(method)
    eng.fence(eng.swap_in([1, 2], [3, 4]))  # first calls: lazy setup (staging, bindings) outside the check
    eng.swap_out([5, 6], [7, 8])
    torch.cuda.synchronize()
    rng = random.Random(5)
    with no_sync_allowed():
        torch.cuda._sleep(4 * SLEEP_CYCLES)  # ~1 s: a call that waited for the GPU would take that long
        t0 = time.perf_counter()
        t_out = eng.swap_out(rng.sample(range(1, 32), 24), rng.sample(range(1, 32), 24))
        t_in = eng.swap_in(rng.sample(range(32, PAGES), 24), rng.sample(range(32, PAGES), 24))
        eng.fence(t_in)
        eng.done(t_out)
        host_s = time.perf_counter() - t0
    eng.synchronize()
    batched_or_skip(eng)
    assert host_s < 0.4, f"the calls took {host_s:.3f} s while the GPU slept: something waited for it"


@pytest.mark.parametrize("numa", [True, None])
def test_registered_host_memory_serves_as_the_host_pool(numa: bool | None) -> None:
    alloc = host_memory.host_kv_tensor(GEOM, PAGES, "cuda", numa=numa)
    assert alloc.how in ("numa-registered", "registered"), alloc.reason
    if numa and alloc.how != "numa-registered":
        pytest.skip(f"NUMA placement refused on this machine: {alloc.reason}")
    assert alloc.tensor.is_pinned()
    assert alloc.tensor.untyped_storage().nbytes() == PAGES * GEOM.page_bytes  # exactly, not rounded up
    _, pool, _ = make("batched")
    host = HostKVPool(GEOM, PAGES, pin=True, data=alloc.tensor)  # as make_host_pool does
    eng = DuplexRotationEngine(pool, host, method="batched")
    before = pool.data.cpu()
    eng.swap_out([2, 4, 6], [10, 11, 12])
    eng.synchronize()
    for d, h in ((2, 10), (4, 11), (6, 12)):
        assert torch.equal(bits(alloc.tensor[h]), bits(before[d]))
