"""Typed messages (msgspec Structs) and their msgpack codec."""

from sglang_ext.messages.codec import decode_from_worker, decode_to_worker, encode
from sglang_ext.messages.io import (
    AbortReq,
    BatchOut,
    ErrorOut,
    FlushCacheReq,
    FromWorker,
    GenerateReq,
    HelloReq,
    LoadReport,
    ReplyOut,
    ShutdownReq,
    TokenizeReq,
    TokenOut,
    ToWorker,
    WorkerHello,
    WorkerInfo,
)

__all__ = [
    "AbortReq",
    "BatchOut",
    "ErrorOut",
    "FlushCacheReq",
    "FromWorker",
    "GenerateReq",
    "HelloReq",
    "LoadReport",
    "ReplyOut",
    "ShutdownReq",
    "ToWorker",
    "TokenOut",
    "TokenizeReq",
    "WorkerHello",
    "WorkerInfo",
    "decode_from_worker",
    "decode_to_worker",
    "encode",
]
