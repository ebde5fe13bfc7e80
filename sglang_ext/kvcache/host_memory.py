"""Pinned host memory for the host KV pool: how much the host has available, and where to put the pool.

Available memory is MemAvailable (/proc/meminfo); `rotation.host_kv_bytes` sizes the pool from it.

Placement (the Grace path). On a Grace–Hopper (GH200) node the CPU's LPDDR5X is reached over NVLink-C2C,
and each GPU is close to one Grace's memory. The GPU's HBM is also onlined as a NUMA node of its own,
with no CPUs: that node is *not* where host KV belongs (it would spend HBM on the "host" pool). The node
we want is the one the GPU's PCI function reports in /sys/bus/pci/devices/<domain:bus:dev.fn>/numa_node:
the CPU node the driver attached it to. `host_kv_tensor` then
  1. maps anonymous memory (mmap),
  2. sets MPOL_PREFERRED for that node with mbind(2) before the first touch (preferred, not bound: a
     full node spills elsewhere instead of OOM-killing the server),
  3. faults its pages in from several threads (madvise MADV_POPULATE_WRITE over slices, Linux >= 5.14),
     each page on that node,
  4. pins and registers it with CUDA (cudaHostRegister, portable),
  5. wraps it as a torch tensor; unregistered and unmapped when the tensor is freed.
Step 3 is for the start-up time: cudaHostRegister faults untouched pages in one thread, and a 32 GiB
pool took 8.4-9.4 s of every lvf server's start on the H100 (2026-12-06, the "scheduler" stage), the kernel
zeroing 8M pages one after another. Populated first, in parallel, registration only pins present pages.
Where madvise refuses (an older kernel), the pages are left to registration as before; the log line
says how long each part took.
Without a node to choose (one node, no NUMA information) or when mbind is refused (containers), steps
1 and 3-5 still run: registering pins exactly the pool's size, where torch's `pin_memory` rounds up to
a power of two. Only when mapping or registration fails does it fall back to torch's `pin_memory=True`,
with the reason logged and returned. mbind is called
through libc's syscall() (no libnuma needed; syscall numbers for x86_64 and aarch64). On x86 machines
with several sockets the same path puts the pool on the GPU's socket.

Untested on GH200: no Grace machine is lent to this project. What has run: mmap + mbind to node 0 on a
one-node x86 CPU machine (unpinned) in the CPU tests; registration is exercised by tests/test_gpu_rotation.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import logging
import os
import platform
import time
import weakref
from pathlib import Path
from typing import Final, NamedTuple

import torch

from sglang_ext.kvcache.pool import KVGeometry

log = logging.getLogger(__name__)

MPOL_PREFERRED: Final = 1
_SYS_MBIND: Final = {"x86_64": 237, "aarch64": 235, "arm64": 235}
_PROT_READ_WRITE: Final = 0x1 | 0x2
_MAP_PRIVATE_ANONYMOUS: Final = 0x02 | 0x20
_MAP_FAILED: Final = ctypes.c_void_p(-1).value
_CUDA_HOST_REGISTER_PORTABLE: Final = 0x1
_MADV_POPULATE_WRITE: Final = 23  # Linux 5.14: fault the range in, writable, as a write to each page would


class HostAlloc(NamedTuple):
    tensor: torch.Tensor
    numa_node: int | None  # the node the memory was placed on, None when not placed
    how: str  # "numa-registered" | "torch-pinned" | "unpinned"
    reason: str  # why this path (for the log and the benchmark's record)


# ---- available memory --------------------------------------------------------------------------------
def mem_available_bytes(meminfo: str | Path = "/proc/meminfo") -> int:
    """MemAvailable; where /proc/meminfo cannot be read, the free physical pages (sysconf)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# ---- placement --------------------------------------------------------------------------------------
def gpu_pci_address(device_index: int) -> str | None:
    """The GPU's PCI address as sysfs names it ("0000:1b:00.0"), from torch's device properties."""
    try:
        p = torch.cuda.get_device_properties(device_index)
        # torch's stub for _CudaDeviceProperties omits the pci_* fields the runtime object has.
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError, AssertionError):  # an old torch, or no CUDA
        return None


def numa_node_of_pci(pci: str, sysfs: str | Path = "/sys") -> int | None:
    """The CPU NUMA node a PCI function is attached to; None when unknown (-1, or no such file)."""
    try:
        node = int((Path(sysfs) / "bus/pci/devices" / pci / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def numa_node_count(sysfs: str | Path = "/sys") -> int:
    base = Path(sysfs) / "devices/system/node"
    try:
        return sum(1 for p in base.iterdir() if p.name.startswith("node") and p.name[4:].isdigit())
    except OSError:
        return 1


def gpu_host_numa_node(device_index: int, sysfs: str | Path = "/sys") -> tuple[int | None, str]:
    """(node, reason): the CPU node near the GPU, or None with why placement is pointless or unknown."""
    if numa_node_count(sysfs) < 2:
        return None, "one NUMA node: nothing to choose"
    pci = gpu_pci_address(device_index)
    if pci is None:
        return None, "GPU PCI address unknown"
    node = numa_node_of_pci(pci, sysfs)
    if node is None:
        return None, f"no NUMA node recorded for PCI device {pci}"
    return node, f"GPU {device_index} ({pci}) is attached to NUMA node {node}"


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.syscall.restype = ctypes.c_long
    return libc


def map_host(nbytes: int, node: int | None) -> tuple[int, str | None]:
    """Anonymous memory (zeroed, untouched) of `nbytes`; with `node`, its pages come from that node where
    it has room, once touched. Returns (address, why placement failed or None); free with `unmap`.
    Raises OSError when mmap itself fails."""
    libc = _libc()
    addr = libc.mmap(None, nbytes, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS, -1, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {nbytes} bytes failed: {os.strerror(err)}")
    if node is None:
        return int(addr), None
    sysno = _SYS_MBIND.get(platform.machine())
    if sysno is None:
        return int(addr), f"mbind syscall number unknown for {platform.machine()}"
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    # maxnode counts one past the bits the kernel reads (its historic off-by-one, as libnuma passes it).
    rc = libc.syscall(ctypes.c_long(sysno), ctypes.c_void_p(addr), ctypes.c_ulong(nbytes), ctypes.c_int(MPOL_PREFERRED),
                      mask, ctypes.c_ulong(64 * words + 1), ctypes.c_uint(0))
    if rc != 0:
        err = ctypes.get_errno()
        return int(addr), f"mbind to node {node} failed: {os.strerror(err)}"
    return int(addr), None


def populate(addr: int, nbytes: int, threads: int | None = None) -> tuple[bool, str]:
    """Fault [addr, addr + nbytes) in from `threads` threads (default: the CPUs this process may use, at
    most 16), one slice each; madvise runs outside the GIL, so the kernel zeroes the slices in parallel.
    Returns (every slice populated, why not / how)."""
    n = max(1, min(threads or len(os.sched_getaffinity(0)), 16))
    page = os.sysconf("SC_PAGE_SIZE")
    step = -(-nbytes // n // page) * page  # slices on page boundaries
    libc = _libc()

    def one(start: int) -> int:
        length = min(step, nbytes - start)
        if libc.madvise(ctypes.c_void_p(addr + start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) != 0:
            return ctypes.get_errno()
        return 0

    with cf.ThreadPoolExecutor(n) as ex:
        errs = [e for e in ex.map(one, range(0, nbytes, step)) if e]
    if errs:
        return False, f"madvise(MADV_POPULATE_WRITE) refused: {os.strerror(errs[0])}"
    return True, f"{n} thread{'s' if n > 1 else ''}"


def unmap(addr: int, nbytes: int) -> None:
    _libc().munmap(addr, nbytes)


def wrap_host_memory(
    addr: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], registered: bool
) -> torch.Tensor:
    """A tensor over [addr, addr + nbytes); the memory is unregistered (if `registered`) and unmapped
    when the last tensor viewing it is freed."""
    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    weakref.finalize(buf, _release, addr, nbytes, registered)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def _release(addr: int, nbytes: int, registered: bool) -> None:
    if registered:
        torch.cuda.cudart().cudaHostUnregister(addr)
    unmap(addr, nbytes)


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                numa: bool | None = None, sysfs: str | Path = "/sys") -> HostAlloc:
    """Host memory of `shape`, pinned for `device` when it is a GPU, on the GPU's NUMA node where that
    helps. `numa`: None = when the machine has several nodes, True = try even on one node, False = never.
    Pinned by mmap + cudaHostRegister even without placement: that pins exactly `nbytes`, where torch's
    pin_memory rounds up to a power of two (a 20 GiB pool would pin 32 GiB)."""
    device = torch.device(device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if device.type != "cuda":
        return HostAlloc(torch.empty(shape, dtype=dtype), None, "unpinned", "device is not a GPU")
    index = device.index if device.index is not None else torch.cuda.current_device()
    node, reason = gpu_host_numa_node(index, sysfs)
    if numa is True and node is None:
        node, reason = 0, f"placement forced to node 0 ({reason})"
    elif numa is False:
        node, reason = None, "NUMA placement off"
    if nbytes > 0:
        try:
            addr, placed = map_host(nbytes, node)
        except OSError as e:
            reason = f"{reason}; mmap failed: {e}"
        else:
            if node is not None and placed is not None:
                reason, node = f"{reason}; NUMA placement failed: {placed}", None
            t0 = time.perf_counter()
            populated, how_pop = populate(addr, nbytes)
            t1 = time.perf_counter()
            err = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
            if err == 0:
                t = wrap_host_memory(addr, nbytes, dtype, shape, registered=True)
                how = "numa-registered" if node is not None else "registered"
                where = f"on NUMA node {node}" if node is not None else "unplaced"
                log.info("host KV pool: %.2f GiB pinned %s (%s; %s %.2f s, registered in %.2f s)", nbytes / 2**30,
                         where, reason, f"populated by {how_pop} in" if populated else how_pop + ";",
                         t1 - t0, time.perf_counter() - t1)
                return HostAlloc(t, node, how, reason)
            unmap(addr, nbytes)
            reason = f"{reason}; cudaHostRegister failed (error {err})"
    log.info("host KV pool: %.2f GiB pinned by torch (%s)", nbytes / 2**30, reason)
    return HostAlloc(torch.empty(shape, dtype=dtype, pin_memory=True), None, "torch-pinned", reason)


def host_kv_tensor(geometry: KVGeometry, num_pages: int, device: torch.device | str,
                   numa: bool | None = None) -> HostAlloc:
    """A host KV pool's `data` in the device pool's block-first layout, for `HostKVPool` to adopt."""
    g = geometry
    shape = (num_pages, g.num_layers, 2, g.page_size, g.num_kv_heads, g.head_dim)
    return host_tensor(shape, g.dtype, device, numa)
