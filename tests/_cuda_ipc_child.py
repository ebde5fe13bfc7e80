"""Child process of tests/test_gpu_cuda_signal.py: maps the parent's buffer and flags (CUDA IPC handles
as hex on the command line), writes a known pattern into the buffer after a long sleep on its stream (so
only the flag can order the parent's read), then sets flag 0. On the exporter's GPU half the pattern goes
by `peer_copy` and half through a torch view of the mapping; from another GPU all of it by `peer_copy`
(a torch view of a peer GPU's memory would belong to that GPU). Prints "ok" when its stream is done.

    python tests/_cuda_ipc_child.py DEVICE EXPORTER_DEVICE NBYTES BUF_HANDLE_HEX FLAG_HANDLE_HEX
"""

from __future__ import annotations

import sys

import torch

from sglang_ext.transport.cuda_signal import IpcMapping, peer_copy
from sglang_ext.transport.protocol import IpcHandle

SLEEP_CYCLES = 200_000_000  # ~0.1 s on an H200: longer than the parent needs to queue its read


def pattern(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """The bytes the child writes: a fixed pseudo-random sequence (not zeros, not a ramp)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(device)


def main(argv: list[str]) -> None:
    device, exporter, nbytes = int(argv[0]), int(argv[1]), int(argv[2])
    torch.cuda.set_device(device)
    buf = IpcMapping(IpcHandle.from_bytes(bytes.fromhex(argv[3])), device)
    flag_map = IpcMapping(IpcHandle.from_bytes(bytes.fromhex(argv[4])), device)
    flags = flag_map.flags(1)
    src = pattern(nbytes, f"cuda:{device}")
    torch.cuda.synchronize(device)  # the upload ran on the default stream; s must see it landed
    s = torch.cuda.Stream(device=device)
    half = nbytes // 2 if device == exporter else nbytes
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        peer_copy(buf.ptr, src.data_ptr(), half, s)
        if half < nbytes:
            buf.tensor(torch.uint8)[half:].copy_(src[half:])
        flags.write(s, 0, 1)
    s.synchronize()
    buf.close()
    flag_map.close()
    print("ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
