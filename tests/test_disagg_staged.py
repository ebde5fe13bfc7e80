"""The `cuda_ipc` KV pair (disagg/staged.py) on CPU: its protocol over a real gloo pair, with the two
GPU-only steps -- mapping the decode worker's stage and the peer copy into it -- replaced by their
host-memory equivalents (one process, so the "mapping" is the stage tensor itself). What CUDA does is
covered on GPUs by tests/test_disagg_served.py (SGLANG_EXT_TEST_DEVICE=cuda): two worker processes
on GPUs of one node pair over cuda_ipc.

Checked here: KV larger than the stage arrives whole, chunk by chunk, in order, byte for byte; the
pair's choice of backend says why it is not cuda_ipc; a chunk out of order ends the pair.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import pytest
import torch

from sglang_ext.disagg import staged
from sglang_ext.disagg.transfer import KVArrival, KVReceiver, KVSender, SendJob
from sglang_ext.kvcache.pool import KVGeometry, KVPool
from sglang_ext.transport import stage as transport_stage
from sglang_ext.transport.link import open_store, recv_blob
from sglang_ext.transport.protocol import LinkError, Reply, Stage
from sglang_ext.transport.stage import KVStage

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float32)


def _host_stage(monkeypatch: pytest.MonkeyPatch, stage: torch.Tensor) -> None:
    """map_stage / push_kv for one process on CPU: the stage is the receiver's tensor itself."""

    def map_stage(link: Any, device: torch.device, timeout_s: float) -> tuple[KVStage, Any]:
        assert recv_blob(link, Stage, timeout_s) == b"h" * 80
        return KVStage(stage.data_ptr(), stage.numel()), None

    def push_kv(st: KVStage, kv: torch.Tensor, timeout_s: float) -> None:
        flat = kv.contiguous().view(torch.uint8).view(-1)
        stage[: flat.numel()].copy_(flat)

    monkeypatch.setattr(staged, "map_stage", map_stage)
    monkeypatch.setattr(transport_stage, "push_kv", push_kv)  # what pushed_chunks calls


def test_kv_larger_than_the_stage_arrives_whole_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = torch.zeros(3 * GEOM.page_bytes, dtype=torch.uint8)  # three pages a chunk
    _host_stage(monkeypatch, stage)
    pool = KVPool(GEOM, 32, "cpu")
    torch.manual_seed(0)
    pool.data.copy_(torch.randn_like(pool.data))
    got: list[KVArrival] = []
    ended: list[str] = []
    done = threading.Event()
    store, listener = open_store("127.0.0.1")
    recv = KVReceiver("pair", "p", GEOM, store, listener, staged.BACKEND, torch.device("cpu"), "127.0.0.1", 10.0,
                      on_kv=got.append, on_end=lambda p, why: (ended.append(why), done.set()),
                      stage=(stage, b"h" * 80))
    sent: list[tuple[str, str | None]] = []
    sender = KVSender("pair", "d", f"127.0.0.1:{store.port}", staged.BACKEND, pool, 10.0,
                      on_done=lambda rid, err: sent.append((rid, err)))
    jobs = [SendJob("a", 1, [5, 9, 2, 7, 11, 3, 20], 26, 42), SendJob("b", 2, [4], 3, 7),
            SendJob("c", 3, [13, 14, 15], 12, 8)]  # 7 pages: chunks 3 + 3 + 1; 1 page; exactly one chunk
    for j in jobs:
        sender.submit(j)
    sender.close()
    assert done.wait(20), "the receiver did not end"
    sender.thread.join(10)
    recv.thread.join(10)
    assert sent == [("a", None), ("b", None), ("c", None)] and not sender.broken
    assert ended == ["closed by the prefill worker"]
    assert [(a.room, a.n_tokens, a.first_token, a.handle) for a in got] == [(1, 26, 42, 0), (2, 3, 7, 0), (3, 12, 8, 0)]
    for a, j in zip(got, jobs, strict=True):
        assert torch.equal(a.kv, pool.data[torch.tensor(j.pages)])
    assert sender.bytes_sent == 11 * GEOM.page_bytes


class _Link:
    def __init__(self) -> None:
        self.headers: list[Any] = []

    def send_header(self, h: Any, timeout_s: float) -> None:
        self.headers.append(h)


def test_a_chunk_without_its_first_ends_the_pair() -> None:
    page = (GEOM.num_layers, 2, GEOM.page_size, GEOM.num_kv_heads, GEOM.head_dim)
    inbox = staged.StagedIn(torch.zeros(2 * GEOM.page_bytes, dtype=torch.uint8), page, GEOM.dtype, 1.0)
    link = _Link()
    with pytest.raises(LinkError, match="without its first chunk"):
        inbox.chunk(link, 1, 4, 2, 2)  # type: ignore[arg-type]
    assert inbox.chunk(link, 1, 4, 0, 2) is None  # type: ignore[arg-type]
    with pytest.raises(LinkError, match="without its first chunk"):
        inbox.chunk(link, 2, 4, 2, 2)  # type: ignore[arg-type]  # another room's
    with pytest.raises(LinkError, match="unexpected staged chunk"):
        inbox.chunk(link, 1, 4, 2, 3)  # type: ignore[arg-type]  # past its pages
    with pytest.raises(LinkError, match="stage holds"):
        inbox.chunk(link, 1, 4, 0, 4)  # type: ignore[arg-type]  # more than the stage
    assert link.headers == [Reply(1)]


def test_the_pair_says_why_it_is_not_cuda_ipc() -> None:
    gpu, host, pid = torch.device("cuda", 0), socket.gethostname(), os.getpid()

    def why(**kw: Any) -> str | None:
        a: dict[str, Any] = dict(own=gpu, own_host=host, own_pid=pid, peer_device="cuda:1", peer_host=host,
                                 peer_gpu="GPU-1", peer_pid=pid + 1)
        a.update(kw)
        return staged.ipc_unusable(**a)

    assert why(own=torch.device("cpu")) == "an end is not a GPU"
    assert why(peer_device="cpu") == "an end is not a GPU"
    assert "another node (node-b)" in str(why(peer_host="node-b"))
    assert "did not say which GPU" in str(why(peer_gpu=""))
    assert "one process" in str(why(peer_pid=pid))
    assert why(disabled=True) == "--disable-pd-kv-ipc"


def test_the_stage_is_whole_pages_and_at_least_one() -> None:
    assert staged.stage_bytes(2 << 20) == 256 << 20
    assert staged.stage_bytes(3 << 20) == 85 * (3 << 20)
    assert staged.stage_bytes(300 << 20) == 300 << 20
