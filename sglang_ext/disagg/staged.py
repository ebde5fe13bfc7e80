"""Prefill -> decode KV over CUDA IPC peer copies, for a pair whose two GPUs are on one node (backend
`cuda_ipc`): the staged copies of transport/stage.py, used for hand-offs.

    decode worker (receiver)                                  prefill worker (sender)
    allocates a stage on its GPU when the pair opens
    Stage(n) + the stage's IpcHandle ── gloo ────────────────> maps it (cuIpcOpenMemHandle)
                                                               per request: pages gathered on its GPU;
                                                               per chunk of at most the stage's size:
                                                               peer copy -> stage, waited for
    copy stage -> the request's KV, wait  <── KVStaged(room, n_tokens, n_pages, first_token, first, count)
    Reply(1) ───────────────────────────────────────────────> (the stage is free again)

Headers stay on the pair's gloo channel (transfer.py says why not NCCL); no NCCL communicator is made
for the pair at all. The pages move GPU to GPU over NVLink (or PCIe) without a host hop, and the
prefill worker's copy runs on a side stream of its own, off its forward stream.

The stage is min(PD_STAGE_MAX_BYTES, ...) in whole pages, at least one page, allocated beside the KV
pool (not out of it). Its memory is freed only after a clean close: a peer that broke mid-copy may
still have a mapping, so then it is kept (rare, and safe). The decode worker's --disable-pd-kv-ipc
turns the backend off (NCCL between GPUs).
"""

from __future__ import annotations

import logging
from typing import Any, Final

import torch

from sglang_ext.transport.link import Link, recv_blob, send_blob
from sglang_ext.transport.protocol import IpcHandle, KVStaged, ProtocolError, Reply, Stage, expect
from sglang_ext.transport.stage import KVStage, copied, pushed_chunks, staged_kv

logger = logging.getLogger(__name__)

BACKEND: Final = "cuda_ipc"
PD_STAGE_MAX_BYTES: Final = 256 << 20
_kept: list[torch.Tensor] = []  # stages a broken peer may still have mapped (never freed)


def stage_bytes(page_bytes: int, max_bytes: int = PD_STAGE_MAX_BYTES) -> int:
    """The stage's size: at most `max_bytes` in whole pages, but at least one page."""
    return max(max_bytes // page_bytes, 1) * page_bytes


def ipc_unusable(own: torch.device, own_host: str, own_pid: int, peer_device: str, peer_host: str, peer_gpu: str,
                 peer_pid: int, disabled: bool = False) -> str | None:
    """Why the pair cannot use cuda_ipc (None: it can, as far as can be told before the handshake);
    `disabled`: the decode worker's --disable-pd-kv-ipc."""
    if disabled:
        return "--disable-pd-kv-ipc"
    if own.type != "cuda" or not peer_device.startswith("cuda"):
        return "an end is not a GPU"
    if not peer_host or peer_host != own_host:
        return f"the prefill worker is on another node ({peer_host or 'unknown'})"
    if not peer_gpu:
        return "the prefill worker did not say which GPU it runs on"
    if peer_pid == own_pid:
        return "both ends are in one process (CUDA IPC maps another process's memory only)"
    from sglang_ext.transport.ipc import ipc_problem

    return ipc_problem(own, peer_device, peer_gpu)


def make_stage(device: torch.device, page_bytes: int) -> tuple[torch.Tensor, bytes]:
    """The receiver's stage on `device` and its exported handle (RuntimeError / ValueError when it
    cannot be made: no memory, or an allocator whose memory cannot be exported)."""
    from sglang_ext.transport import cuda_signal as cs

    stage = torch.empty(stage_bytes(page_bytes), dtype=torch.uint8, device=device)
    return stage, cs.export_tensor(stage).to_bytes()


def release_stage(stage: torch.Tensor | None, clean: bool) -> None:
    """Let the stage go: freed after a clean close, kept after a broken pair."""
    if stage is not None and not clean:
        _kept.append(stage)


# ---- the receiver's end ----------------------------------------------------------------------------
def offer_stage(link: Link, handle: bytes, timeout_s: float) -> None:
    send_blob(link, Stage(len(handle)), handle, timeout_s)


class StagedIn:
    """The decode end's state for KVStaged messages: the request being received, chunk by chunk."""

    def __init__(self, stage: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, timeout_s: float) -> None:
        self.stage = stage
        self.page_shape = shape  # one page: (L, 2, P, Hkv, D)
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.kv: torch.Tensor | None = None
        self.room = -1

    def chunk(self, link: Link, room: int, n_pages: int, first: int, count: int) -> torch.Tensor | None:
        """Copy a chunk out of the stage into the request's KV and free the stage (REPLY); returns the
        whole KV once its last chunk landed."""
        if n_pages < 1 or n_pages > 1 << 24 or count < 1 or first + count > n_pages:
            raise ProtocolError(f"unexpected staged chunk {first}+{count} of {n_pages} pages")
        if first == 0:
            self.kv = torch.empty((n_pages, *self.page_shape), dtype=self.dtype, device=self.stage.device)
            self.room = room
        elif self.kv is None or room != self.room or self.kv.shape[0] != n_pages:
            raise ProtocolError(f"staged chunk {first}.. of room {room} without its first chunk")
        try:
            src = staged_kv(self.stage, (count, *self.page_shape), self.dtype)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        self.kv[first : first + count].copy_(src)
        copied(self.stage.device, self.timeout_s)  # before the stage is written again
        link.send_header(Reply(1), self.timeout_s)
        if first + count < n_pages:
            return None
        kv, self.kv = self.kv, None
        return kv


# ---- the sender's end ------------------------------------------------------------------------------
def map_stage(link: Link, device: torch.device, timeout_s: float) -> tuple[KVStage, Any]:
    """Receive the decode worker's stage handle and map it here: (the stage, its mapping to close)."""
    from sglang_ext.transport import cuda_signal as cs

    handle = IpcHandle.from_bytes(recv_blob(link, Stage, timeout_s))
    mapping = cs.IpcMapping(handle, device.index or 0)
    return KVStage(mapping.ptr, mapping.nbytes, torch.cuda.Stream(device)), mapping


def send_staged(link: Link, stage: KVStage, kv: torch.Tensor, room: int, n_tokens: int, first_token: int,
                timeout_s: float) -> None:
    """Push `kv` ([n_pages, L, 2, P, Hkv, D] on this GPU) through the stage in chunks of its size."""
    kv = kv.contiguous()
    n = kv.shape[0]
    for first, chunk in pushed_chunks(stage, kv, timeout_s):
        link.send_header(KVStaged(room, n_tokens, n, first_token, first, chunk.shape[0]), timeout_s)
        if not expect(link.recv_header(timeout_s), Reply).value:
            raise ProtocolError("the decode worker refused a staged chunk")
