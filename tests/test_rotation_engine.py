"""The rotation engines on CPU tensors: the reference `RotationEngine`, every `DuplexRotationEngine`
method and the benchmark's variants of it (bench/rotation_variants.py) move page contents exactly
(scattered pages, contiguous runs, chunks of a small staging buffer, empty lists); the copy plans merge
and cut runs as documented; bad page lists are refused; the batch-copy binding reads both cuda-python
result shapes; host-pool sizing and NUMA placement helpers."""

from __future__ import annotations

import ctypes
import os
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rotation_variants import ALL_METHODS, HostRun, make_engine, plan_staged
from sglang_ext.kvcache import host_memory, memcpy_batch
from sglang_ext.kvcache.allocator import PageAllocator
from sglang_ext.kvcache.copy_plan import Run, check_pages, plan_runs
from sglang_ext.kvcache.duplex import DuplexRotationEngine
from sglang_ext.kvcache.host_pool import HostKVPool
from sglang_ext.kvcache.pool import KVGeometry, KVPool
from sglang_ext.kvcache.rotation import RotationEngine

GEOM = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=4, page_size=2, dtype=torch.float32)


def pools(dev_pages: int = 24, host_pages: int = 20) -> tuple[KVPool, HostKVPool]:
    pool = KVPool(GEOM, dev_pages, "cpu")
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)))
    pool.data[0].zero_()
    host = HostKVPool(GEOM, host_pages, pin=False)
    host.data.fill_(-7.0)  # defined contents: torch.empty may hold NaNs, which never compare equal
    return pool, host


def engine(method: str, pool: KVPool, host: HostKVPool, staging_pages: int = 3) -> RotationEngine:
    if method == "reference":
        return RotationEngine(pool, host)
    return make_engine(method, pool, host, staging_bytes=staging_pages * GEOM.page_bytes)


CASES = {
    "scattered": ([7, 2, 19, 11, 4], [3, 15, 8, 1, 12]),
    "contiguous": ([5, 6, 7, 8, 9, 10, 11], [2, 3, 4, 5, 6, 7, 8]),
    "mixed_runs": ([3, 4, 5, 20, 21, 9, 1, 2], [10, 11, 12, 1, 2, 19, 6, 7]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("method", ["reference", *ALL_METHODS])
def test_round_trip_is_exact(method: str, case: str) -> None:
    pool, host = pools()
    eng = engine(method, pool, host)
    dev, hst = CASES[case]
    before = pool.data.clone()
    t = eng.swap_out(dev, hst)
    assert eng.done(t) and t.num_pages == len(dev) and t.nbytes == len(dev) * GEOM.page_bytes
    for d, h in zip(dev, hst, strict=True):
        assert torch.equal(host.data[h], before[d])
    # Back into other device pages, in another order.
    back = [p for p in range(1, pool.num_pages) if p not in dev][: len(dev)]
    random.Random(1).shuffle(back)
    pool.data[back] = 0.0
    t = eng.swap_in(hst, back)
    assert eng.done(t)
    for d, b in zip(dev, back, strict=True):
        assert torch.equal(pool.data[b], before[d])
    untouched = [p for p in range(pool.num_pages) if p not in back]
    assert torch.equal(pool.data[untouched], before[untouched])
    assert eng.bytes_out == eng.bytes_in == len(dev) * GEOM.page_bytes


@pytest.mark.parametrize("method", ["reference", *ALL_METHODS])
def test_empty_lists_move_nothing(method: str) -> None:
    pool, host = pools()
    eng = engine(method, pool, host)
    before, hbefore = pool.data.clone(), host.data.clone()
    for t in (eng.swap_out([], []), eng.swap_in([], [])):
        assert t.num_pages == 0 and t.nbytes == 0 and eng.done(t)
        eng.fence(t)
    eng.synchronize()
    assert torch.equal(pool.data, before) and torch.equal(host.data, hbefore)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_bad_page_lists_are_refused_before_any_copy(method: str) -> None:
    pool, host = pools()
    eng = engine(method, pool, host)
    hbefore = host.data.clone()
    with pytest.raises(ValueError, match="differ in length"):
        eng.swap_out([1, 2], [3])
    with pytest.raises(ValueError, match="source page 24 outside"):
        eng.swap_out([1, 24], [3, 4])
    with pytest.raises(ValueError, match="destination page 0 outside"):
        eng.swap_out([1, 2], [0, 4])
    with pytest.raises(ValueError, match="appears twice"):
        eng.swap_out([1, 2], [5, 5])
    with pytest.raises(ValueError, match="source page 20 outside"):
        eng.swap_in([20], [1])
    assert torch.equal(host.data, hbefore)
    assert eng.bytes_out == eng.bytes_in == 0


def test_batched_falls_back_on_cpu_with_a_reason() -> None:
    pool, host = pools()
    eng = DuplexRotationEngine(pool, host, method="batched")
    assert eng.method == "runs" and eng.requested_method == "batched"
    assert eng.fallback_reason and "CPU" in eng.fallback_reason
    with pytest.raises(ValueError, match="rotation method"):
        DuplexRotationEngine(pool, host, method="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rotation method"):
        DuplexRotationEngine(pool, host, method="staged")  # type: ignore[arg-type]  # a bench variant only


def test_plan_runs_merges_where_both_sides_are_consecutive() -> None:
    assert plan_runs([], []) == []
    assert plan_runs([5, 6, 7, 10], [1, 2, 3, 4]) == [Run(5, 1, 3), Run(10, 4, 1)]
    # Sorted by source first, so pairs given out of order still merge.
    assert plan_runs([7, 5, 6], [3, 1, 2]) == [Run(5, 1, 3)]
    # Source consecutive, destination not: no merge.
    assert plan_runs([1, 2], [4, 3]) == [Run(1, 4, 1), Run(2, 3, 1)]


def test_plan_staged_groups_host_runs_and_cuts_at_capacity() -> None:
    chunks = plan_staged(dev=[9, 3, 7, 1, 5], host=[4, 5, 6, 10, 11], capacity=2)
    assert [c.dev_pages for c in chunks] == [[9, 3], [7, 1], [5]]
    assert [c.host_runs for c in chunks] == [[HostRun(0, 4, 2)], [HostRun(0, 6, 1), HostRun(1, 10, 1)],
                                             [HostRun(0, 11, 1)]]
    one = plan_staged(dev=[2, 8, 4], host=[7, 1, 2], capacity=8)
    assert len(one) == 1 and one[0].dev_pages == [8, 4, 2]
    assert one[0].host_runs == [HostRun(0, 1, 2), HostRun(2, 7, 1)]
    with pytest.raises(ValueError):
        plan_staged([1], [1], 0)


def test_check_pages_accepts_a_valid_transfer() -> None:
    check_pages([1, 2, 3], [3, 2, 1], 4, 4)
    check_pages([], [], 2, 2)


def test_alloc_lowest_gives_runs_after_fragmentation() -> None:
    a = PageAllocator(16)
    pages = a.alloc(10)
    a.free([pages[i] for i in (7, 2, 5, 3, 4)])  # free 8, 3, 6, 4, 5 in scattered order
    assert a.alloc_lowest(4) == [3, 4, 5, 6]


class _Err(int):
    pass


def test_batch_copy_reads_both_result_shapes_and_wraps_pointers() -> None:
    calls: list[tuple] = []

    def fn12(*args: object) -> tuple:  # cuda-python 12.x: (err, failIdx)
        calls.append(args)
        return (_Err(0), None)

    bc = memcpy_batch.BatchCopy("fake12", fn12, "attr", None, int, lambda e: (0, b"cudaSuccess"))
    bc([10, 20], [30, 40], [8, 8], 7)
    assert calls[-1] == ([10, 20], [30, 40], [8, 8], 2, ["attr"], [0], 1, 7)
    bc([], [], [], 7)
    assert len(calls) == 1  # nothing enqueued for an empty batch

    def fn13(*args: object) -> tuple:  # cuda-python 13.x: (err,)
        calls.append(args)
        return (_Err(1),)

    name = lambda e: (0, b"cudaErrorInvalidValue")  # noqa: E731
    bc = memcpy_batch.BatchCopy("fake13", fn13, "attr", lambda p: ("ptr", p), int, name)
    with pytest.raises(memcpy_batch.BatchCopyUnavailable, match="cudaErrorInvalidValue"):
        bc([1], [2], [8], 0)
    assert calls[-1][0] == [("ptr", 1)] and calls[-1][1] == [("ptr", 2)]


def test_available_memory_from_meminfo(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       1000 kB\nMemFree:        500 kB\nMemAvailable:   800 kB\n")
    assert host_memory.mem_available_bytes(f) == 800 * 1024
    # unreadable: the free physical pages instead
    assert host_memory.mem_available_bytes(tmp_path / "missing") == os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_AVPHYS_PAGES")


def test_gpu_numa_node_from_sysfs(tmp_path: Path) -> None:
    for n in (0, 1):
        (tmp_path / f"devices/system/node/node{n}").mkdir(parents=True)
    dev = tmp_path / "bus/pci/devices/0000:1b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    assert host_memory.numa_node_count(tmp_path) == 2
    assert host_memory.numa_node_of_pci("0000:1b:00.0", tmp_path) == 1
    (dev / "numa_node").write_text("-1\n")
    assert host_memory.numa_node_of_pci("0000:1b:00.0", tmp_path) is None
    assert host_memory.numa_node_of_pci("0000:ff:00.0", tmp_path) is None


def test_memory_mapped_on_a_node_is_usable_and_freed_with_its_last_view() -> None:
    nbytes = 1 << 20
    addr, placement_error = host_memory.map_host(nbytes, 0)
    if placement_error is not None:
        host_memory.unmap(addr, nbytes)
        pytest.skip(f"mbind not permitted here: {placement_error}")
    freed: list[int] = []
    release = host_memory._release
    host_memory._release = lambda a, n, r: (freed.append(a), release(a, n, r))  # type: ignore[assignment]
    try:
        t = host_memory.wrap_host_memory(addr, nbytes, torch.float32, (256, 1024), registered=False)
        assert t.data_ptr() == addr and float(t.sum()) == 0.0  # anonymous memory starts zeroed
        t.fill_(2.0)
        row = t[3]
        del t
        assert freed == [] and float(row.sum()) == 2048.0  # a view keeps the mapping alive
        del row
        import gc

        gc.collect()
        assert freed == [addr]
    finally:
        host_memory._release = release  # type: ignore[assignment]


def _rss_kib() -> int:
    return next(int(ln.split()[1]) for ln in Path("/proc/self/status").read_text().splitlines()
                if ln.startswith("VmRSS:"))


def test_populate_faults_the_pages_in_from_several_threads() -> None:
    """The host pool is faulted in before cudaHostRegister, in parallel slices (registration faults
    untouched pages one thread at a time: 8-9 s for 32 GiB on the H100). The pages are resident after,
    zeroed and writable; a kernel that refuses MADV_POPULATE_WRITE leaves them to registration, said so."""
    nbytes = 64 * 2**20 + 3 * os.sysconf("SC_PAGE_SIZE")  # not a multiple of the slices
    addr, _ = host_memory.map_host(nbytes, None)
    try:
        before = _rss_kib()
        ok, how = host_memory.populate(addr, nbytes, threads=4)
        if not ok:
            assert "MADV_POPULATE_WRITE" in how
            pytest.skip(f"this kernel has no MADV_POPULATE_WRITE: {how}")
        assert how == "4 threads" and _rss_kib() - before >= 60 * 1024  # the range is resident
        view = (ctypes.c_uint8 * nbytes).from_address(addr)
        t = torch.frombuffer(view, dtype=torch.uint8)
        assert int(t.max()) == 0
        t[-1] = 7  # the last, partial slice is writable too
        assert int(t[-1]) == 7
        del t, view
    finally:
        host_memory.unmap(addr, nbytes)


def test_host_tensor_for_a_cpu_device_is_plain() -> None:
    a = host_memory.host_kv_tensor(GEOM, 4, "cpu")
    assert a.how == "unpinned" and a.tensor.shape == (4, 3, 2, 2, 2, 4) and a.numa_node is None
