"""An SM partition between a worker's own model and the attention executor it hosts
(`executor_reserved_sms`): Adrenaline's resource partition, inside one process.

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
"""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_streams: dict[int, torch.cuda.Stream] = {}  # device index -> the model's stream in its partition


def make(device: torch.device, reserved: int) -> torch.cuda.Stream:
    """The model's stream on `device`, in a green context of all SMs but `reserved` (made once per device).
    ValueError when `reserved` leaves the model no SM."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
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
    idx = device.index if device.index is not None else torch.cuda.current_device()
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
