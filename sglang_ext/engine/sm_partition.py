"""SM partitions between a worker's own model and the attention executor it hosts, inside one process:
`executor_reserved_sms` (Adrenaline's: SMs kept for the executor) and `executor_max_sms` (the other
way round: a bound on what hosting costs the host's own model).

The executor's per-layer programs run on a high-priority stream of the host's GPU, but a kernel of the
host model that holds every SM keeps them until its blocks retire, so each of the executor's kernels,
32 layers a step, may wait for SMs (measured: a busy host GPU adds 1.4-1.7 ms to a step with remote
rows, docs/benchmarks.md). Adrenaline bounds the prefill model's SMs with MPS, between processes; here
the executor is a thread of the host, so the model's work goes to a stream of a CUDA green context
that holds all SMs but `reserved` (rounded by the driver: multiples of 8 on Hopper). The executor's
streams stay in the primary context: the reserved SMs are always free for them, and they may use the
others too.

The model's stream is made current on the threads that run it (`enter`: the loading thread when the
runner is built, the forward thread through `bind_device`), and its CUDA graphs are captured on it, so
that their replays run in the partition. The green context and its stream come from FlashInfer's
`green_ctx` helpers (cuda-python's driver API), imported on first use.

Measured on two H200s (2026-11-30, docs/benchmarks.md): against a prefill worker's compute-bound GEMMs,
24 reserved SMs took a decode worker's steps with remote rows from 8.5-9.9 ms to 7.0-7.4 ms; against a
memory-bound decode load (`bench/remote_step.py --load-confine green`) it helps little, as there the
executor waits for bandwidth, not SMs.

`executor_max_sms` confines the executor instead: each of its programs gets its own high-priority
stream in one green context of that many SMs, and the model keeps every SM (it may use the executor's
while they are idle). A cold model hosting a hot model's KV (WEAVER) loses to the executor what the
executor's kernels take from the GPU; an executor on a few SMs can draw only part of the HBM
bandwidth, so the host's step slows less and the guest's remote rows wait longer instead
(bench/remote_host.py measures both sides).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_streams: dict[int, torch.cuda.Stream] = {}  # device index -> the model's stream in its partition
_exec_ctx: dict[int, tuple[Any, int]] = {}  # device index -> (the executor's green context, its SMs)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def make(device: torch.device, reserved: int) -> torch.cuda.Stream:
    """The model's stream on `device`, in a green context of all SMs but `reserved` (made once per device).
    ValueError when `reserved` leaves the model no SM."""
    idx = _index(device)
    with _lock:
        if idx in _streams:
            return _streams[idx]
        total = torch.cuda.get_device_properties(idx).multi_processor_count
        if not 0 < reserved < total:
            raise ValueError(f"executor_reserved_sms={reserved}: {device} has {total} SMs")
        from flashinfer.green_ctx import split_device_green_ctx_by_sm_count

        dev = torch.device("cuda", idx)
        streams, resources = split_device_green_ctx_by_sm_count(dev, [total - reserved])
        stream = streams[0]
        _streams[idx] = stream
        got = resources[0].sm.smCount
        logger.info("SM partition on %s: the model runs on %d SMs, %d are the executor's alone", dev, got,
                    total - got)
        return stream


def stream_for(device: torch.device) -> torch.cuda.Stream | None:
    """The model's stream on `device` if it runs in a partition (None: no partition)."""
    if device.type != "cuda":
        return None
    idx = _index(device)
    return _streams.get(idx)


def enter(device: torch.device) -> None:
    """Make the model's partition stream current on the calling thread (nothing without a partition).
    Work this thread queued before on its old stream comes first."""
    s = stream_for(device)
    if s is None:
        return
    old = torch.cuda.current_stream(device)
    if old != s:
        s.wait_stream(old)
        torch.cuda.set_stream(s)


def cap_executor(device: torch.device, sms: int) -> int:
    """Confine the executor programs made from now on on `device` to one green context of `sms` SMs
    (rounded up by the driver; 0 lifts the cap). Returns the SMs the context holds (0: uncapped).
    ValueError when `sms` is not below the device's SM count."""
    idx = _index(device)
    with _lock:
        if sms == 0:
            _exec_ctx.pop(idx, None)
            return 0
        total = torch.cuda.get_device_properties(idx).multi_processor_count
        if not 0 < sms < total:
            raise ValueError(f"executor_max_sms={sms}: {device} has {total} SMs")
        from flashinfer.cuda_utils import checkCudaErrors, driver
        from flashinfer.green_ctx import get_cudevice, get_device_resource, split_resource_by_sm_count

        cu_dev = get_cudevice(torch.device("cuda", idx))
        groups, _rest = split_resource_by_sm_count(cu_dev, get_device_resource(cu_dev), [sms])
        desc = checkCudaErrors(driver.cuDevResourceGenerateDesc([groups[0]], 1))
        ctx = checkCudaErrors(driver.cuGreenCtxCreate(
            desc, cu_dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        got = int(groups[0].sm.smCount)
        _exec_ctx[idx] = (ctx, got)
        logger.info("executor cap on cuda:%d: hosted attention runs on %d of %d SMs", idx, got, total)
        return got


def executor_stream(device: torch.device, priority: int = -1) -> torch.cuda.Stream | None:
    """A new stream for one executor program in the executor's partition on `device` (None: uncapped).
    One per program: each pairing's program waits on its own doorbells, so two pairings sharing a
    stream could hold each other up. The stream lives as long as the process (a pairing is made rarely;
    destroying it under torch, which may still track blocks allocated on it, is not worth the bytes)."""
    if device.type != "cuda":
        return None
    idx = _index(device)
    ent = _exec_ctx.get(idx)
    if ent is None:
        return None
    from flashinfer.cuda_utils import checkCudaErrors, driver

    raw = checkCudaErrors(driver.cuGreenCtxStreamCreate(
        ent[0], driver.CUstream_flags.CU_STREAM_NON_BLOCKING, priority))
    return torch.cuda.get_stream_from_external(raw, torch.device("cuda", idx))
