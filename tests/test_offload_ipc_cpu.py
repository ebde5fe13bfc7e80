"""The cuda_ipc transport across processes, what of it runs without a GPU: the choice of a served
pairing's transport, the handshake's messages and their checks, the sender's watchdog (a state
machine with a fake flag array, and over a real gloo pair whose host process dies or says
goodbye), and the host's end of the control protocol (plans on Begin and never waits for layers;
drains its queued programs before it releases the guest's KV, and keeps the KV if they will not
drain), and KV loads through the host's stage (stage.py: a CPU tensor as the stage, a raw memmove
as the sender's peer copy). The GPU half is tests/test_offload_served.py with
SGLANG_EXT_TEST_DEVICE=cuda."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from typing import Any

import msgspec
import pytest
import torch

from sglang_ext.kvcache.pool import KVGeometry
from sglang_ext.offload import dist, ipc_host
from sglang_ext.offload.dist import DistRemote
from sglang_ext.offload.executor import AttentionExecutor, GuestSpec
from sglang_ext.offload.host import ExecutorHost, ExecutorService
from sglang_ext.offload.ipc import StagedRemote, exchange_shape
from sglang_ext.offload.partition import ForeignKVPartition
from sglang_ext.offload.remote import ExecutorLost
from sglang_ext.transport import stage
from sglang_ext.transport.choice import Choice, WorkerSite, choose_transport
from sglang_ext.transport.ipc import check_hello, check_welcome
from sglang_ext.transport.link import (
    HOST_RANK,
    SENDER_RANK,
    Link,
    connect_store,
    open_store,
    say_goodbye,
    wait_for_goodbye,
)
from sglang_ext.transport.protocol import (
    Begin,
    Close,
    Header,
    IpcHello,
    IpcWelcome,
    Load,
    LoadMore,
    LoadStaged,
    Reply,
    Tag,
)
from sglang_ext.transport.watchdog import ARMED, RELEASING, STOPPED, Watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = GuestSpec(KVGeometry(2, 2, 16, 4, torch.bfloat16), 4, 16, 0.25)


# ---- which transport ------------------------------------------------------------------------------
GPU_A, GPU_B = WorkerSite("hot-0", "n1", "cuda:0"), WorkerSite("cold-0", "n1", "cuda:1")


@pytest.mark.parametrize(("asked", "sender", "host", "want"), [
    (None, GPU_A, GPU_B, Choice("cuda_ipc", "torch_dist")),  # GPUs of one node: cuda_ipc, may fall back
    (None, GPU_A, GPU_B._replace(device="cuda:0"), Choice("cuda_ipc", "torch_dist")),  # even one GPU
    (None, GPU_A, GPU_B._replace(hostname="n2"), Choice("torch_dist", "")),  # two nodes
    (None, GPU_A, GPU_B._replace(device="cpu"), Choice("torch_dist", "")),
    (None, GPU_A._replace(hostname=""), GPU_B, Choice("torch_dist", "")),  # an older worker: no host name
    ("torch_dist", GPU_A, GPU_B, Choice("torch_dist", "")),
    ("cuda_ipc", GPU_A, GPU_B, Choice("cuda_ipc", "")),  # forced: no fallback, the host refuses instead
])
def test_the_transport_follows_the_placement(asked: str | None, sender: WorkerSite, host: WorkerSite,
                                             want: Choice) -> None:
    assert choose_transport(asked, sender, host) == want


def test_a_sender_that_asks_for_torch_dist_turns_the_automatic_cuda_ipc_off() -> None:
    assert choose_transport(None, GPU_A, GPU_B) == Choice("cuda_ipc", "torch_dist")
    assert choose_transport("torch_dist", GPU_A, GPU_B) == Choice("torch_dist", "")


@pytest.mark.parametrize(("sender", "host", "needle"), [
    (GPU_A, GPU_B._replace(hostname="n2"), "hot-0 runs on n1 and cold-0 on n2"),
    (GPU_A._replace(device="cpu"), GPU_B, "hot-0 runs on cpu, not a GPU"),
])
def test_a_forced_cuda_ipc_that_cannot_work_is_an_error(sender: WorkerSite, host: WorkerSite, needle: str) -> None:
    with pytest.raises(ValueError, match="offload_transport cuda_ipc needs both workers on GPUs of one node") as e:
        choose_transport("cuda_ipc", sender, host)
    assert needle in str(e.value)
    with pytest.raises(ValueError, match="in-process executor"):
        choose_transport("local", GPU_A, GPU_B)


def test_a_host_without_gpus_refuses_cuda_ipc_or_falls_back() -> None:
    from test_offload_dist import open_msg

    host = ExecutorHost(AttentionExecutor(ForeignKVPartition(1 << 22, "cpu", slab_bytes=1 << 15)))
    msg = msgspec.structs.replace(open_msg(SPEC), transport="cuda_ipc", guest_device="cuda:0")
    with pytest.raises(ValueError, match="offload_transport cuda_ipc: cuda_ipc needs GPUs at both ends"):
        host.open(msg)
    assert not host.executor.guests  # nothing attached
    data = host.open(msgspec.structs.replace(msg, fallback="torch_dist", guest_device="cpu"))
    assert data["transport"] == "torch_dist" and data["backend"] == "gloo"
    (svc,) = host.services.values()
    DistRemote.connect(data["store"], "gloo", torch.device("cpu"), SPEC, "host-0", 5.0).close()
    assert svc.ended.wait(5)


# ---- the handshake's messages ---------------------------------------------------------------------
def handle(nbytes: int) -> bytes:
    return b"\x01" * 64 + (0).to_bytes(8, "little") + nbytes.to_bytes(8, "little")


def test_hello_and_welcome_round_trip_and_are_checked() -> None:
    shape = exchange_shape(SPEC, 8)
    assert (shape.width_in, shape.width_out) == ((4 + 2 * 2) * 16, 4 * 16)
    shape_of = partial(exchange_shape, SPEC)
    hello = IpcHello(8, handle(8 * 64 * 2), handle(2 * 4), gpu="GPU-1234")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(hello), type=IpcHello)
    assert back == hello and check_hello(back, shape_of) == shape
    with pytest.raises(ValueError, match="recv buffer is not 8 x 64"):
        check_hello(IpcHello(8, handle(8 * 64 * 4), handle(8)), shape_of)  # float32-sized: not the guest's dtype
    with pytest.raises(ValueError, match="done flags are not 2 int32"):
        check_hello(IpcHello(8, handle(8 * 64 * 2), handle(4)), shape_of)
    with pytest.raises(ValueError, match="max_rows 0 is not in"):
        check_hello(IpcHello(0, handle(0), handle(8)), shape_of)
    with pytest.raises(ValueError, match="recv: an IPC handle is 80 bytes, got 3"):
        check_hello(IpcHello(8, b"abc", handle(8)), shape_of)
    with pytest.raises(msgspec.ValidationError):  # strict: unknown fields are refused
        msgspec.msgpack.decode(msgspec.msgpack.encode({**msgspec.structs.asdict(hello), "x": 1}), type=IpcHello)
    page = SPEC.geometry.page_bytes
    assert check_welcome(IpcWelcome(handle(8 * 128 * 2), handle(8)), shape, page) == 0  # no stage
    with pytest.raises(ValueError, match="no peer path"):
        check_welcome(IpcWelcome(error="no peer path"), shape, page)
    with pytest.raises(ValueError, match="exec_in buffer is not 8 x 128"):
        check_welcome(IpcWelcome(handle(8 * 64 * 2), handle(8)), shape, page)


# ---- the watchdog ---------------------------------------------------------------------------------
class FakeFlags:
    """Stands in for the sender's done flags: a stuck wait drains once a release raised them."""

    def __init__(self) -> None:
        self.raised = threading.Event()
        self.fills = 0

    def release(self) -> None:
        self.fills += 1
        self.raised.set()


def until(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_watchdog_releases_until_stopped_when_the_peer_is_gone() -> None:
    gone = threading.Event()
    flags = FakeFlags()
    w = Watchdog(lambda: gone.wait() and "connection closed by peer", flags.release, "t", interval_s=1e-3)
    w.start()
    time.sleep(0.05)
    assert w.state == ARMED and w.lost is None and flags.fills == 0
    gone.set()
    assert flags.raised.wait(5)
    until(lambda: flags.fills >= 3)  # again and again: step t+1 may be queued behind the same flags
    assert w.state == RELEASING and w.lost == "connection closed by peer" and w.peer_ended.is_set()
    w.stop()
    w.join(5)
    n = flags.fills
    time.sleep(0.02)
    assert w.state == STOPPED and flags.fills == n


def test_watchdog_after_a_goodbye_releases_nothing() -> None:
    flags = FakeFlags()
    w = Watchdog(lambda: None, flags.release, "t")
    w.start()
    assert w.peer_ended.wait(5)
    w.join(1)
    assert w.state == STOPPED and w.lost is None and flags.fills == 0
    w.fire("too late")  # a stopped watchdog stays stopped
    assert w.state == STOPPED


def test_watchdog_fired_by_the_forward_thread_or_a_failing_wait() -> None:
    flags = FakeFlags()
    block = threading.Event()
    w = Watchdog(lambda: block.wait() and None, flags.release, "t")
    w.start()
    w.fire("begin_step: timed out after 5 s")  # the control channel saw it first
    assert flags.raised.wait(5) and w.lost == "begin_step: timed out after 5 s"
    w.stop()
    block.set()

    def broken() -> str | None:
        raise RuntimeError("Connection reset by peer")

    flags2 = FakeFlags()
    w2 = Watchdog(broken, flags2.release, "t2")
    w2.start()
    assert flags2.raised.wait(5) and w2.lost == "RuntimeError: Connection reset by peer"
    w2.stop()


_stores: list[Any] = []


def linked_pair() -> tuple[Link, Link]:
    store, listener = open_store("127.0.0.1")
    host: list[Link] = []
    t = threading.Thread(target=lambda: host.append(Link(store, HOST_RANK, "gloo", torch.device("cpu"), "127.0.0.1")))
    t.start()
    sender = Link(connect_store(f"127.0.0.1:{store.port}"), SENDER_RANK, "gloo", torch.device("cpu"), "127.0.0.1")
    t.join()
    _stores.append((store, listener))  # the store uses the listener's descriptor while it lives
    return host[0], sender


def test_goodbye_over_gloo_while_control_messages_flow() -> None:
    """The watchdog's receive waits on its own tag while the control channel is used."""
    host, sender = linked_pair()
    result: list[str | None] = []
    t = threading.Thread(target=lambda: result.append(wait_for_goodbye(sender)))
    t.start()

    def answer() -> None:  # the host's thread (a gloo send completes once the peer receives)
        for _ in range(5):
            i = host.recv_header(5)
            assert isinstance(i, Begin)
            host.send_header(Reply(i.n_rows), 5)

    h = threading.Thread(target=answer)
    h.start()
    for i in range(5):
        sender.send_header(Begin(i), 5)
        assert sender.recv_header(5) == Reply(i)
    h.join(5)
    assert t.is_alive()
    say_goodbye(host, 5)
    t.join(5)
    assert result == [None]
    host.close()
    sender.close()


_DYING_HOST = """
import sys, time, torch
sys.path[:0] = [{root!r}]
from sglang_ext.transport.link import HOST_RANK, Link, connect_store
link = Link(connect_store({address!r}), HOST_RANK, "gloo", torch.device("cpu"), "127.0.0.1")
print("up", flush=True)
time.sleep(600)
"""


def test_watchdog_sees_a_killed_host_process_at_once() -> None:
    """SIGKILL the host's process while the sender's watchdog waits: its sockets close, the wait
    ends with an error, and the flags are released -- no timeout involved."""
    store, listener = open_store("127.0.0.1")
    address = f"127.0.0.1:{store.port}"
    # the store's server is on the sender's side here (which end serves it does not matter)
    proc = subprocess.Popen([sys.executable, "-c", _DYING_HOST.format(root=ROOT, address=address)],
                            stdout=subprocess.PIPE, text=True)
    try:
        sender = Link(store, SENDER_RANK, "gloo", torch.device("cpu"), "127.0.0.1")
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        flags = FakeFlags()
        w = Watchdog(lambda: wait_for_goodbye(sender), flags.release, "killed")
        w.start()
        time.sleep(0.1)
        assert w.state == ARMED
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert flags.raised.wait(10), "the watchdog did not notice the dead host"
        assert time.monotonic() - t0 < 5 and w.state == RELEASING and w.lost
        w.stop()
    finally:
        proc.kill()
        proc.wait(10)
        _stores.append((store, listener))


# ---- the host's end of the control protocol -------------------------------------------------------
F32 = GuestSpec(KVGeometry(2, 2, 16, 4, torch.float32), 4, 16, 0.25)


class FakeProgram:
    """GatedProgram's host-side calls without a GPU: plans, and counts what it would queue."""

    def __init__(self, executor: AttentionExecutor, guest: str) -> None:
        self.executor, self.guest, self.steps, self.loads = executor, guest, list[list[int]](), 0

    def before_load(self) -> None:
        self.loads += 1

    def plan(self, handles: list[int], positions: list[int]) -> list[int]:
        self.steps.append(handles)
        return self.executor.plan(self.guest, handles, positions)

    def queue(self) -> None:  # the host answers the sender between plan() and queue()
        self.queued += 1

    queued = 0


class FakeEnd:
    def __init__(self, program: FakeProgram, drains: bool, stage_bytes: int = 0) -> None:
        self.program, self.drains, self.drained, self.closed = program, drains, 0, False
        # The host's KV stage: in host memory here, written by the fake peer copy (see `staged_pair`)
        self.stage = torch.zeros(stage_bytes, dtype=torch.uint8) if stage_bytes else None

    def drain(self, timeout_s: float = 0.0) -> bool:
        self.drained += 1
        return self.drains

    def close(self) -> None:
        self.closed = True


def serve_ipc(monkeypatch: pytest.MonkeyPatch, drains: bool,
              stage_bytes: int = 0, timeout_s: float = 5.0) -> tuple[ExecutorService, FakeEnd, Link]:
    executor = AttentionExecutor(ForeignKVPartition(1 << 22, "cpu", slab_bytes=1 << 15))
    executor.attach("hot-0/p1", F32)
    end = FakeEnd(FakeProgram(executor, "hot-0/p1"), drains, stage_bytes)
    monkeypatch.setattr(ipc_host.IpcHostEnd, "handshake", staticmethod(lambda *a, **k: end))
    store, listener = open_store("127.0.0.1")
    svc = ExecutorService(executor, threading.Lock(), "hot-0/p1", F32, store, "gloo", torch.device("cpu"),
                          "127.0.0.1", timeout_s, listener=listener, transport="cuda_ipc")
    svc.start()
    link = Link(connect_store(f"127.0.0.1:{store.port}"), SENDER_RANK, "gloo", torch.device("cpu"), "127.0.0.1")
    return svc, end, link


def load_and_step(link: Link) -> None:
    link.send_header(Load(7, 10, 3), 5)
    link.send(torch.randn(3, 2, 2, 4, 2, 16), Tag.CTRL, 5)
    assert link.recv_header(5) == Reply(1)
    for pos in (10, 11):  # two steps back to back: the host never waits for a layer's q|k|v
        link.send_header(Begin(1), 5)
        link.send(torch.tensor([[7], [pos]], dtype=torch.int64), Tag.CTRL, 5)
        assert link.recv_header(5) == Reply(0)


def test_host_plans_on_begin_and_drains_before_its_goodbye(monkeypatch: pytest.MonkeyPatch) -> None:
    svc, end, link = serve_ipc(monkeypatch, drains=True)
    bye: list[str | None] = []
    t = threading.Thread(target=lambda: bye.append(wait_for_goodbye(link)))
    t.start()
    load_and_step(link)
    assert end.program.steps == [[7], [7]] and end.program.loads == 1
    assert svc.executor.used_tokens("hot-0/p1") == 12
    link.send_header(Close(), 5)
    t.join(5)
    assert bye == [None] and end.drained >= 1  # drained, then the goodbye
    assert svc.ended.wait(5) and end.closed and not svc.executor.guests
    svc.executor.check()
    link.close()


def test_a_vanished_sender_whose_program_will_not_drain_keeps_its_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages a queued program may still write are never given to another guest."""
    svc, end, link = serve_ipc(monkeypatch, drains=False)
    load_and_step(link)
    link.close()  # as a killed process's sockets close
    assert svc.ended.wait(5)
    assert end.drained == 1 and not end.closed
    assert svc.executor.used_tokens("hot-0/p1") == 12  # kept: the program may still write them


# ---- KV loads through the host's stage (stage.py) ---------------------------------------------------
PAGE = F32.geometry.page_bytes


pushed: list[int] = []  # pages per push, as the fake peer copy saw them


def fake_push(st: stage.KVStage, kv: torch.Tensor, timeout_s: float) -> None:
    """The sender's raw peer copy into the host's stage, as a raw copy between addresses of this process
    (the 'host' is a thread here, its stage a CPU tensor)."""
    assert kv.is_contiguous() and kv.numel() * kv.element_size() <= st.nbytes
    ctypes.memmove(st.ptr, kv.data_ptr(), kv.numel() * kv.element_size())
    pushed.append(kv.shape[0])


def staged_pair(monkeypatch: pytest.MonkeyPatch, stage_pages: int) -> tuple[ExecutorService, FakeEnd, Any]:
    """A host serving cuda_ipc's control half (fakes for its GPU end) with a stage of `stage_pages`, and
    the sender's end that maps it as IpcRemote's handshake does (check_welcome, then a KVStage)."""
    svc, end, link = serve_ipc(monkeypatch, drains=True, stage_bytes=stage_pages * PAGE)
    monkeypatch.setattr(stage, "push_kv", fake_push)
    pushed.clear()
    remote = StagedRemote(link, F32, "cold-0", 5.0)
    welcome = IpcWelcome(handle(8 * 128 * 4), handle(8), stage=handle(stage_pages * PAGE) if stage_pages else b"")
    nbytes = check_welcome(welcome, exchange_shape(F32, 8), PAGE)
    if nbytes:
        assert end.stage is not None
        remote.stage = stage.KVStage(end.stage.data_ptr(), nbytes)
    return svc, end, remote


def held(svc: ExecutorService, h: int) -> torch.Tensor:
    g = svc.executor.guests["hot-0/p1"]
    return g.backend.pool.data[g.seqs[h].pages]


def test_a_staged_load_lands_the_same_kv_as_the_gloo_path(monkeypatch: pytest.MonkeyPatch) -> None:
    svc, end, remote = staged_pair(monkeypatch, stage_pages=4)
    kv = torch.randn(3, 2, 2, 4, 2, 16)
    assert remote.load(7, kv, 10)  # staged: fits the stage
    assert remote.staged_loads == 1 and remote.bytes_out == kv.numel() * 4 and remote.wait_s > 0
    assert DistRemote.load(remote, 8, kv, 10)  # the same KV over gloo (Load)
    assert remote.staged_loads == 1
    assert torch.equal(held(svc, 7), kv) and torch.equal(held(svc, 8), held(svc, 7))
    big = torch.randn(9, 2, 2, 4, 2, 16)  # larger than the stage: in chunks of the stage's 4 pages
    assert remote.load(9, big, 34)
    assert remote.staged_loads == 2 and torch.equal(held(svc, 9), big) and pushed == [3, 4, 4, 1]
    assert remote.bytes_out == (3 + 3 + 9) * PAGE  # staged, over gloo, staged in chunks
    assert remote.load(10, kv[:2].clone(), 5)  # the stage is reused: the next load overwrites it
    assert remote.staged_loads == 3 and torch.equal(held(svc, 10), kv[:2])
    assert torch.equal(held(svc, 7), kv)  # the earlier staged request's pages kept their KV
    assert end.program.loads == 4  # every load (not every chunk) waited for the guest's last program
    assert remote.begin_step([7, 9, 10], [10, 34, 5]) == []  # the loaded lengths are what the host plans from
    assert svc.executor.guests["hot-0/p1"].seqs[9].length == 35
    svc.executor.check()
    remote.close()
    assert svc.ended.wait(5) and not svc.executor.guests


@pytest.mark.parametrize("stage_pages", [128, 50])  # one chunk; three, refused at the first
def test_a_full_executor_answers_a_staged_load_with_no(monkeypatch: pytest.MonkeyPatch, stage_pages: int) -> None:
    svc, _, remote = staged_pair(monkeypatch, stage_pages=stage_pages)
    huge = torch.zeros(120, 2, 2, 4, 2, 16)
    n = 0
    while remote.load(100 + n, huge, 480):
        n += 1
        assert n < 100, "the partition never filled"
    assert n >= 1 and remote.alive and remote.staged_loads == n  # full: the request stays local, the pairing lives
    assert svc.executor.used_tokens("hot-0/p1") == n * 120 * 4  # the refused one took nothing
    assert remote.load(200, huge[:2], 8)  # and the pairing goes on
    remote.close()
    assert svc.ended.wait(5)


def test_a_host_without_a_stage_gets_loads_over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """An older host (its welcome has no stage field) or one too small for a page: the gloo path."""
    old = {"exec_in": handle(8 * 128 * 4), "doorbell": handle(8), "error": ""}
    welcome = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=IpcWelcome)
    assert welcome.stage == b"" and check_welcome(welcome, exchange_shape(F32, 8), PAGE) == 0
    svc, end, remote = staged_pair(monkeypatch, stage_pages=0)
    assert remote.stage is None and end.stage is None
    kv = torch.randn(3, 2, 2, 4, 2, 16)
    assert remote.load(7, kv, 10) and remote.staged_loads == 0
    assert torch.equal(held(svc, 7), kv)
    remote.close()
    assert svc.ended.wait(5)


def test_the_stage_is_checked_and_sized(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = exchange_shape(F32, 8)
    base = IpcWelcome(handle(8 * 128 * 4), handle(8))
    assert check_welcome(msgspec.structs.replace(base, stage=handle(3 * PAGE)), shape, PAGE) == 3 * PAGE
    with pytest.raises(ValueError, match="stage of 6145 bytes is not whole pages of 2048 bytes"):
        check_welcome(msgspec.structs.replace(base, stage=handle(3 * PAGE + 1)), shape, PAGE)
    too_big = (stage.STAGE_MAX_BYTES // PAGE + 1) * PAGE
    with pytest.raises(ValueError, match=f"stage of {too_big} bytes"):
        check_welcome(msgspec.structs.replace(base, stage=handle(too_big)), shape, PAGE)
    with pytest.raises(ValueError, match="stage: an IPC handle is 80 bytes"):
        check_welcome(msgspec.structs.replace(base, stage=b"xyz"), shape, PAGE)
    assert stage.stage_bytes(1 << 22, PAGE) == (1 << 22) // 16  # a sixteenth, whole pages
    assert stage.stage_bytes(3 * (1 << 20), 3000) == 196608 // 3000 * 3000
    assert stage.stage_bytes(64 << 30, 2 << 20) == stage.STAGE_MAX_BYTES  # Llama-3-8B pages, 64 GiB
    assert stage.stage_bytes(16 * PAGE - 1, PAGE) == 0  # not one page: no stage


@pytest.mark.parametrize("after", [
    LoadMore(7, 0, 4),  # the first chunk again
    LoadMore(7, 4, 4),  # more than is left (1 page)
    LoadMore(8, 4, 1),  # another request
    Begin(1),  # anything else before the load ended
])
def test_a_staged_load_out_of_order_ends_the_pairing(monkeypatch: pytest.MonkeyPatch, after: Header) -> None:
    """A sender that breaks the chunk protocol is a protocol error, not a crash or a hang: the pairing
    ends and the guest's KV is released."""
    svc, _, remote = staged_pair(monkeypatch, stage_pages=4)
    remote.link.send_header(LoadStaged(7, 20, 5), 5)  # 5 pages: 4 now, 1 to come
    assert remote.link.recv_header(5) == Reply(1)
    remote.link.send_header(after, 5)
    assert svc.ended.wait(5) and not svc.executor.guests
    remote.link.close()


def test_a_lone_load_more_ends_the_pairing(monkeypatch: pytest.MonkeyPatch) -> None:
    svc, _, remote = staged_pair(monkeypatch, stage_pages=4)
    remote.link.send_header(LoadMore(7, 0, 1), 5)
    assert svc.ended.wait(5) and not svc.executor.guests
    remote.link.close()


# ---- BEGIN without waiting for the answer (dist.PipelinedBegin, what IpcRemote does) ---------------
class Piped(dist.PipelinedBegin, StagedRemote):
    """IpcRemote's control half without its GPU end: loads over gloo (no stage), pipelined BEGINs."""


def test_begin_does_not_wait_and_loads_reserve_the_longest(monkeypatch: pytest.MonkeyPatch) -> None:
    svc, end, link = serve_ipc(monkeypatch, drains=True)
    remote = Piped(link, F32, "cold-0", 5.0)
    ps = F32.geometry.page_size
    assert remote.load(7, torch.randn(1, 2, 2, ps, 2, 16), 10, reserve_tokens=4 * ps)
    assert len(svc.executor.guests["hot-0/p1"].seqs[7].pages) == 4  # pages for its longest, set aside now
    assert remote.begin_step([7], [10]) == [] and remote._pending  # sent; the answer is read later
    assert remote.begin_step([7], [11]) == [] and remote._pending == 2  # the first answer was read on the way
    # step 1 lands (under overlap, after step 2 was planned): step 2's answer is not waited for
    assert not remote.results_forged(upto=1) and remote._pending == 2
    assert not remote.results_forged(upto=2) and not remote._pending and remote.alive
    assert remote.load(8, torch.randn(1, 2, 2, ps, 2, 16), 5, reserve_tokens=2 * ps)  # answers stay in step
    assert end.program.steps == [[7], [7]]
    used = svc.executor.partition.used_pages("hot-0/p1")
    assert remote.begin_step([7, 8], [12, 5]) == []
    assert not remote.results_forged()  # the answer read: the host has planned
    assert svc.executor.partition.used_pages("hot-0/p1") == used  # no page needed: all set aside at load
    remote.close()
    assert svc.ended.wait(5)


def test_an_answer_left_unread_does_not_block_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender whose last remote step's answer stays unread (its remote requests finished before
    that step landed, and no remote step came after) for longer than the host's send timeout: the
    host's answer must not wait on the sender (a gloo send completes only once the peer receives), or
    the host ends the pairing -- what the first Adrenaline run on two H200s did, 6 s in."""
    svc, end, link = serve_ipc(monkeypatch, drains=True, timeout_s=0.5)
    remote = Piped(link, F32, "cold-0", 5.0)
    ps = F32.geometry.page_size
    assert remote.load(7, torch.randn(1, 2, 2, ps, 2, 16), 10, reserve_tokens=4 * ps)
    assert remote.begin_step([7], [10]) == [] and remote._pending
    time.sleep(1.5)  # three host timeouts, the answer unread
    assert not svc.ended.is_set() and remote.alive
    assert remote.begin_step([7], [11]) == []
    assert not remote.results_forged() and remote.alive and end.program.steps == [[7], [7]]
    remote.close()
    assert svc.ended.wait(5)


def test_a_row_dropped_after_the_step_was_launched_ends_the_pairing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that drops a row the sender already posted (no room, and no pages set aside): that
    step's remote results are misaligned, so they count as forged and the pairing ends."""
    svc, _, link = serve_ipc(monkeypatch, drains=True)
    remote = Piped(link, F32, "cold-0", 5.0)
    ps = F32.geometry.page_size
    assert remote.load(7, torch.randn(1, 2, 2, ps, 2, 16), ps)  # full page, nothing set aside
    monkeypatch.setattr(svc.executor.partition, "alloc", lambda guest, n: None)  # no room to grow
    assert remote.begin_step([7], [ps]) == []
    assert remote.results_forged() and not remote.alive
    with pytest.raises(ExecutorLost):
        remote.begin_step([7], [ps])
    assert not remote.load(9, torch.randn(1, 2, 2, ps, 2, 16), 3)  # gone: stays local, never raises
    assert svc.ended.wait(5)
