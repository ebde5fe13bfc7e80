"""transport/protocol.py: every header kind round-trips through its int64[8] layout; a header of an
unknown kind, of the wrong size or dtype, with stray fields, or of another kind than expected is a
ProtocolError that says so; IPC handles round-trip through their 80 bytes."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.transport import protocol as p

SAMPLES: list[p.Header] = [
    p.Reply(1), p.Close(), p.Load(7, 10, 3, 40), p.LoadStaged(7, 10, 5, 40), p.LoadMore(7, 4, 1), p.Release(7),
    p.Begin(12), p.Hello(300), p.Bye(), p.KV(3, 17, 5, 42), p.Placed(3, 17, 9, 42), p.Stage(80),
    p.KVStaged(3, 17, 5, 42, 4, 1),
]


def test_every_kind_has_a_sample() -> None:
    assert sorted(h.kind for h in SAMPLES) == sorted(p.Kind)


@pytest.mark.parametrize("h", SAMPLES, ids=lambda h: type(h).__name__)
def test_every_header_round_trips(h: p.Header) -> None:
    t = p.pack(h)
    assert t.dtype == torch.int64 and t.shape == (p.HEADER_WORDS,)
    assert int(t[0]) == h.kind and t[1 : 1 + len(p.fields(h))].tolist() == list(p.fields(h))
    assert not t[1 + len(p.fields(h)) :].any()
    assert p.unpack(t) == h and type(p.unpack(t)) is type(h)
    assert p.expect(p.unpack(t), type(h)) == h


def test_large_values_keep_their_bits() -> None:
    h = p.Load((1 << 62) + 5, 1 << 40, 0, 0)
    assert p.unpack(p.pack(h)) == h


def test_an_omitted_reserve_is_zero() -> None:
    assert p.Load(7, 10, 3) == p.Load(7, 10, 3, 0)


def test_an_unknown_kind_is_refused() -> None:
    t = torch.zeros(p.HEADER_WORDS, dtype=torch.int64)
    t[0] = 99
    with pytest.raises(p.ProtocolError, match="unknown message kind 99"):
        p.unpack(t)
    with pytest.raises(p.ProtocolError, match="unknown message kind 0"):
        p.unpack(torch.zeros(p.HEADER_WORDS, dtype=torch.int64))


@pytest.mark.parametrize("t", [torch.zeros(7, dtype=torch.int64), torch.zeros(9, dtype=torch.int64),
                               torch.zeros(2, 8, dtype=torch.int64), torch.zeros(8, dtype=torch.int32)])
def test_a_wrong_size_or_dtype_is_refused(t: torch.Tensor) -> None:
    t.view(-1)[0] = int(p.Kind.CLOSE)
    with pytest.raises(p.ProtocolError, match="a header is 8 int64"):
        p.unpack(t)


def test_stray_fields_are_refused() -> None:
    t = p.pack(p.Release(7))
    t[3] = 1
    with pytest.raises(p.ProtocolError, match="a Release header has 1 field"):
        p.unpack(t)


def test_another_kind_than_expected_is_refused() -> None:
    with pytest.raises(p.ProtocolError, match=r"expected Reply, got Close\(\)"):
        p.expect(p.Close(), p.Reply)


def test_a_protocol_error_breaks_the_pair() -> None:
    assert issubclass(p.ProtocolError, p.LinkError)  # the ends treat it as a broken pair


def test_ipc_handles_round_trip_through_80_bytes() -> None:
    h = p.IpcHandle(bytes(range(64)), 4096, 3 << 20)
    data = h.to_bytes()
    assert len(data) == 80 and p.IpcHandle.from_bytes(data) == h
    with pytest.raises(ValueError, match="stage: an IPC handle is 80 bytes, got 81"):
        p.IpcHandle.from_bytes(data + b"x", "stage")
