"""msgpack encoding of messages; no pickle anywhere on the wire."""

from __future__ import annotations

import msgspec

from sglang_ext.messages.io import FromWorker, ToWorker

_enc = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)


def encode(msg: msgspec.Struct) -> bytes:
    return _enc.encode(msg)


def decode_to_worker(buf: bytes) -> ToWorker:
    return _to_worker.decode(buf)


def decode_from_worker(buf: bytes | memoryview) -> FromWorker:
    return _from_worker.decode(buf)
