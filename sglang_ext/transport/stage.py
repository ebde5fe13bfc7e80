"""Staged KV copies between the GPUs of one node: a request's KV goes GPU to GPU through a buffer the
receiving end exports (a `cuda_ipc` pairing's executor host at its handshake, a PD decode worker when
its pair opens), instead of through the gloo control channel (GPU -> CPU -> TCP -> CPU -> GPU).
Shown for remote attention (the PD hand-off, disagg/staged.py, is the same with KVStaged):

    sender (GPU a)                                          host (GPU b), its ExecutorService thread
    kv = pages gathered on a ([n, L, 2, P, Hkv, D])
    push kv -> stage (cuMemcpyDtoDAsync on a side
      stream), wait for it
    LoadStaged(handle, length, n, reserve) ───────────────>  kv = stage[:bytes] viewed as the first pages;
                                                             under the lock: allocate all n pages,
                                                             index-copy on this thread's stream (after
                                                             the guest's last program), wait for the copy
             <─────────────────────────────── Reply(1 ok | 0 full)   (the stage is free again)
    KV larger than the stage goes in chunks of the stage's size, each pushed and then announced:
    LoadMore(handle, first, count) ───────────────────────>  copy into pages first.. (as above)
             <─────────────────────────────── Reply(1)

The stage is one per pairing, `stage_bytes` of the host's partition (at most 1 GiB, a sixteenth of it,
whole guest pages). It is allocated beside the partition, not out of it: the partition's arena is one
allocation made when the worker starts, so `executor_mem_gb` does not shrink. A stage smaller than one
page (a tiny partition) is not made: loads then take the gloo path (`Load`).

Order: the gated program that reads those pages is queued on Begin, later than the Reply, and its
stream waits for this thread's stream first (GatedProgram), so it never reads pages before the copy;
the copy itself waits for the guest's last queued program (`before_load`: freed pages it may still
read). The host waits for the copy before it replies, so the sender may overwrite the stage next.
"""

from __future__ import annotations

import faulthandler
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import torch

from sglang_ext.transport.protocol import LinkError

logger = logging.getLogger(__name__)
SLOW_WAIT_S: Final = 3.0
STAGE_MAX_BYTES: Final = 1 << 30
STAGE_FRACTION: Final = 16  # of the partition's bytes


def stage_bytes(partition_bytes: int, page_bytes: int, max_bytes: int = STAGE_MAX_BYTES) -> int:
    """The stage a host allocates for a guest: min(max_bytes, partition / 16) in whole pages (0: none)."""
    return min(max_bytes, partition_bytes // STAGE_FRACTION) // page_bytes * page_bytes


def check_stage(nbytes: int, page_bytes: int) -> None:
    """ValueError unless a welcome's stage is whole pages and at most STAGE_MAX_BYTES (0: no stage)."""
    if nbytes == 0:
        return
    if nbytes % page_bytes or nbytes > STAGE_MAX_BYTES:
        raise ValueError(f"stage of {nbytes} bytes is not whole pages of {page_bytes} bytes up to "
                         f"{STAGE_MAX_BYTES}")


def wait_event(event: Any, timeout_s: float, what: str, error: type[Exception] = LinkError) -> None:
    """Poll a CUDA event until it completed, at most `timeout_s` (`error` after that). A wait that
    lasts SLOW_WAIT_S logs every thread's stack once: these waits end in microseconds unless a GPU
    wait chain is stuck, and the stacks say where."""
    t0 = time.monotonic()
    deadline, slow = t0 + timeout_s, t0 + SLOW_WAIT_S
    while not event.query():
        now = time.monotonic()
        if now > deadline:
            raise error(f"{what} did not finish in {timeout_s:g} s")
        if now > slow:
            slow = float("inf")
            logger.warning("%s: still waiting after %.0f s; every thread's stack follows", what, now - t0)
            faulthandler.dump_traceback(all_threads=True)
        time.sleep(1e-4)


# ---- the sender's end -----------------------------------------------------------------------------
@dataclass
class KVStage:
    """The host's stage as the sender sees it: its address here (an IPC mapping) and size."""

    ptr: int
    nbytes: int
    stream: Any = None  # torch.cuda.Stream on the sender's GPU (None in CPU tests)

    def pages(self, kv: torch.Tensor) -> int:
        """How many of kv's pages one chunk holds (0: not one)."""
        return self.nbytes // (kv[0].numel() * kv.element_size()) if kv.shape[0] else 0


def push_kv(stage: KVStage, kv: torch.Tensor, timeout_s: float) -> None:
    """Copy `kv` (contiguous, on the sender's GPU) into the host's stage and wait until it landed. The
    copy is a raw peer copy on a side stream, which first waits for the stream that gathered `kv`."""
    from sglang_ext.transport import cuda_signal as cs

    s = stage.stream
    s.wait_stream(torch.cuda.current_stream(kv.device))
    cs.peer_copy(stage.ptr, kv.data_ptr(), kv.numel() * kv.element_size(), s)
    done = torch.cuda.Event()
    done.record(s)
    wait_event(done, timeout_s, "the KV copy into the executor's stage")


def pushed_chunks(stage: KVStage, kv: torch.Tensor, timeout_s: float) -> Iterator[tuple[int, torch.Tensor]]:
    """Push `kv` (contiguous) through the stage a chunk of its size at a time: yields (first page, chunk)
    once the chunk landed, for the caller to announce; the next chunk is pushed when the caller comes
    back (after the peer said the stage is free). LinkError when the stage holds no page of it."""
    per = stage.pages(kv)
    if per < 1:
        raise LinkError(f"the peer's stage ({stage.nbytes} bytes) holds no page")
    for first in range(0, kv.shape[0], per):
        chunk = kv[first : first + per]
        push_kv(stage, chunk, timeout_s)
        yield first, chunk


# ---- the host's end ------------------------------------------------------------------------------
def staged_kv(stage: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The first pages of the stage (flat uint8) as a request's KV; ValueError when they do not fit."""
    nbytes = torch.empty(0, dtype=dtype).element_size()
    for s in shape:
        nbytes *= s
    if not 0 < nbytes <= stage.numel():
        raise ValueError(f"a staged load of {nbytes} bytes; the stage holds {stage.numel()}")
    return stage[:nbytes].view(dtype).view(shape)


def copied(device: torch.device, timeout_s: float) -> None:
    """Wait for the work queued so far on this thread's stream of `device` (the copy out of the stage)."""
    if device.type != "cuda":
        return
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    wait_event(done, timeout_s, "the KV copy out of the stage")
