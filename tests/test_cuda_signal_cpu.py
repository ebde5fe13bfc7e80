"""What of the GPU-signalled exchange can be checked without a GPU: the primitives import and fail with a
clear error when cuda-python is absent, IPC handles survive their byte form, flag indices are bounded, and
the remote-attention bench's pipe protocol (JSON lines + one-byte hand-offs, every read with a timeout)
carries messages, tokens, errors and timeouts. The GPU behaviour itself is tests/test_gpu_cuda_signal.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ra_exchange import Geometry
from bench.ra_ipc import Link
from sglang_ext.transport import cuda_signal as cs
from sglang_ext.transport.protocol import IpcHandle


def test_missing_cuda_python_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cs, "_driver", None)
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, None)  # makes the import fail
    with pytest.raises(cs.CudaSignalError, match="needs cuda-python"):
        cs.driver()


def test_ipc_handle_bytes_round_trip_and_validation() -> None:
    h = IpcHandle(bytes(range(64)), offset=4096, nbytes=3 << 20)
    data = h.to_bytes()
    assert len(data) == 80
    assert IpcHandle.from_bytes(data) == h
    with pytest.raises(ValueError, match="80 bytes"):
        IpcHandle.from_bytes(data + b"x")


def test_flag_index_is_bounded() -> None:
    flags = cs.FlagArray(0x1000, 4, device=0)
    assert flags.addr(3) == 0x1000 + 12
    for bad in (-1, 4):
        with pytest.raises(IndexError):
            flags.addr(bad)


def test_exchange_sizes_are_llama3_8b_rows() -> None:
    geo = Geometry()
    assert geo.in_bytes(16) == 16 * (32 + 16) * 128 * 2
    assert geo.out_bytes(256) == 256 * 32 * 128 * 2


def test_link_carries_messages_tokens_and_errors() -> None:
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    a, b = Link(r1, w2), Link(r2, w1)
    try:
        a.send({"op": "run", "bs": 64})
        b.send_token()
        b.send({"ok": True})
        assert b.recv(1.0) == {"op": "run", "bs": 64}
        a.recv_token(1.0)  # the token arrived before the message that follows it
        assert a.recv(1.0) == {"ok": True}
        b.send({"error": "run: TimeoutError: x"})
        with pytest.raises(RuntimeError, match="executor process: run: TimeoutError"):
            a.recv(1.0)
        with pytest.raises(TimeoutError):
            a.recv(0.05)
        b.send({"late": 1})
        with pytest.raises(RuntimeError, match="expected a hand-off token"):
            a.recv_token(1.0)
        assert a.recv(1.0) == {"late": 1}  # a wrong token check consumes nothing
        os.close(w1)
        w1 = -1
        with pytest.raises(EOFError):
            a.recv(1.0)
    finally:
        for fd in (r1, w1, r2, w2):
            if fd >= 0:
                os.close(fd)
