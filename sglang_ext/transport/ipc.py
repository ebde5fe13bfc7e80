"""What a `cuda_ipc` pair checks before and during its handshake: whether CUDA IPC can work between this
process's GPU and a peer's (`ipc_problem`), and whether the buffers a peer's IpcHello or IpcWelcome
(protocol.py) names fit the exchange. Shared by remote attention (offload/ipc.py, offload/ipc_host.py)
and the PD hand-off (disagg/staged.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from sglang_ext.transport.gated import ExchangeShape
from sglang_ext.transport.protocol import MAX_ROWS, IpcHandle, IpcHello, IpcWelcome
from sglang_ext.transport.stage import check_stage


def local_gpu(uuid: str) -> int | None:
    """This process's index of the GPU with `uuid` (None: not visible here)."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None


def ipc_problem(own_device: torch.device, peer_device: str, peer_gpu: str) -> str | None:
    """Why a cuda_ipc pair between this process's `own_device` and a peer on `peer_device` (GPU
    `peer_gpu`) cannot work (None: it can, as far as can be told before the handshake)."""
    if own_device.type != "cuda" or not peer_device.startswith("cuda"):
        return f"cuda_ipc needs GPUs at both ends (executor on {own_device}, sender on {peer_device})"
    from sglang_ext.transport import cuda_signal as cs

    try:
        cs.driver()
    except cs.CudaSignalError as e:
        return str(e)
    if peer_gpu:
        idx = local_gpu(peer_gpu)
        if idx is None:
            return f"the sender's GPU {peer_gpu} is not visible to this worker (CUDA_VISIBLE_DEVICES)"
        try:
            if not cs.can_access_peer(own_device.index or 0, idx):
                return f"GPU {own_device} cannot reach the sender's GPU (cuda:{idx} here): no peer path"
        except cs.CudaSignalError as e:
            return str(e)
    return None


def _size(data: bytes, what: str) -> int:
    """The buffer size an IpcHandle's bytes name (ValueError if they are not one)."""
    return IpcHandle.from_bytes(data, what).nbytes


def check_hello(hello: IpcHello, shape_of: Callable[[int], ExchangeShape]) -> ExchangeShape:
    """The exchange a hello describes (`shape_of(max_rows)`); ValueError when its buffers do not fit."""
    if not 1 <= hello.max_rows <= MAX_ROWS:
        raise ValueError(f"max_rows {hello.max_rows} is not in [1, {MAX_ROWS}]")
    shape = shape_of(hello.max_rows)
    if _size(hello.recv, "recv") != shape.max_rows * shape.width_out * shape.elem:
        raise ValueError(f"recv buffer is not {shape.max_rows} x {shape.width_out} {shape.dtype}")
    if _size(hello.done, "done") != 4 * shape.layers:
        raise ValueError(f"done flags are not {shape.layers} int32")
    return shape


def check_welcome(w: IpcWelcome, shape: ExchangeShape, page_bytes: int) -> int:
    """ValueError when the welcome is an error or its buffers do not fit; returns the stage's bytes."""
    if w.error:
        raise ValueError(w.error)
    if _size(w.exec_in, "exec_in") != shape.max_rows * shape.width_in * shape.elem:
        raise ValueError(f"exec_in buffer is not {shape.max_rows} x {shape.width_in} {shape.dtype}")
    if _size(w.doorbell, "doorbell") != 4 * shape.layers:
        raise ValueError(f"doorbell flags are not {shape.layers} int32")
    if not w.stage:
        return 0  # a host without a stage
    nbytes = _size(w.stage, "stage")
    check_stage(nbytes, page_bytes)
    return nbytes


def device_idle(device: torch.device, timeout_s: float) -> bool:
    """Wait for every stream of the device (the exchange may run on any of the sender's), at most
    `timeout_s`: the synchronisation runs on a helper thread, so a wait that never ends cannot hold us."""
    t = threading.Thread(target=torch.cuda.synchronize, args=(device,), name="ipc-drain", daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()
