"""Remote attention over torch.distributed (gloo): a sender's `DistRemote` and a host's
`ExecutorService`, in one process on two threads and across two processes. Attention outputs equal
the in-process executor's; greedy outputs equal those without offload (prefix hits, chunked prefill,
preemption); pages are accounted for on both sides after every step; a peer that vanishes is an
`ExecutorLost` within the timeout on the sender and a release of the guest's KV on the host. The
overlap scheduler plans step t+1 over the pair while t is in flight, with the same outputs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _tiny import VOCAB, greedy, make_scheduler, prompts

from sglang_ext.kvcache.pool import KVGeometry
from sglang_ext.messages import ExecutorOpen
from sglang_ext.offload.dist import DistRemote
from sglang_ext.offload.executor import AttentionExecutor, GuestSpec
from sglang_ext.offload.host import ExecutorHost
from sglang_ext.offload.partition import ForeignKVPartition
from sglang_ext.offload.remote import ExecutorLost
from sglang_ext.offload.sender import RemoteSender
from sglang_ext.offload.setup import guest_spec
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler
from sglang_ext.transport.link import HOST_RANK, Link, open_store

LENGTHS = [5, 17, 33, 9, 40, 3, 21, 12]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def open_msg(spec: GuestSpec, guest: str = "tiny", timeout_s: float = 5.0) -> ExecutorOpen:
    g = spec.geometry
    return ExecutorOpen(rid="r", guest=guest, guest_model="tiny", pairing="p1", num_layers=g.num_layers,
                        num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, page_size=g.page_size,
                        dtype=str(g.dtype).removeprefix("torch."), num_q_heads=spec.num_q_heads, scale=spec.scale,
                        guest_device="cpu", timeout_s=timeout_s)


_remotes: list[DistRemote] = []  # closed after each test, so no service thread outlives it


def pair(host: ExecutorHost, spec: GuestSpec, timeout_s: float = 5.0) -> DistRemote:
    data = host.open(open_msg(spec, timeout_s=timeout_s))
    remote = DistRemote.connect(data["store"], data["backend"], torch.device("cpu"), spec, "host-0", timeout_s)
    _remotes.append(remote)
    return remote


def new_host(budget: int = 1 << 22) -> ExecutorHost:
    return ExecutorHost(AttentionExecutor(ForeignKVPartition(budget, "cpu", slab_bytes=1 << 15)))


def sender(overlap: bool = False, **args: Any) -> Scheduler:
    s = make_scheduler(**args)
    if overlap:
        return Scheduler(s.args, s.runner, s.page_size, s.eos_ids, vocab_size=VOCAB, overlap=True)
    return s


def offload_over_gloo(s: Scheduler, host: ExecutorHost, ratio: float) -> DistRemote:
    """What a worker does on an OffloadDirective."""
    remote = pair(host, guest_spec(s.runner))  # type: ignore[arg-type]
    s.runner.set_remote(remote)  # type: ignore[attr-defined]
    s.remote_residency.set_sender(RemoteSender(remote, ratio, s.runner.pool))
    return remote


def reqs(max_new: int = 12, ps: list[list[int]] | None = None) -> list[Req]:
    return [Req(f"r{i}", p, greedy(max_new)) for i, p in enumerate(ps or prompts(LENGTHS))]


def drive(s: Scheduler, rs: list[Req], host: ExecutorHost | None = None, each: Any = None) -> dict[str, list[int]]:
    """Run to the end; check the sender's pages (and the host's, between steps) after every step."""
    for r in rs:
        s.add_request(r)
    out: dict[str, list[int]] = {r.rid: [] for r in rs}
    for step in range(5000):
        if not s.has_work():
            break
        if each is not None:
            each(step)
        for o in s.step():
            out[o.rid].extend(o.new_token_ids)
        s.kv.check(s.running + s.waiting)
        if host is not None:
            time.sleep(0)  # a release is one-way: let the service take it
            with host.lock:
                host.executor.check()
    assert not s.has_work()
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return drive(make_scheduler(), reqs())


@pytest.fixture(autouse=True)
def close_remotes() -> Iterator[None]:
    yield
    while _remotes:
        _remotes.pop().close()


@pytest.fixture
def host() -> Iterator[ExecutorHost]:
    h = new_host()
    yield h
    while _remotes:
        _remotes.pop().close()
    for svc in list(h.services.values()):
        assert svc.ended.wait(5)


def test_attention_matches_the_in_process_executor(host: ExecutorHost) -> None:
    geo = KVGeometry(2, 2, 16, 4, torch.float32)
    spec = GuestSpec(geo, 4, 16, 0.25)
    ref = AttentionExecutor(ForeignKVPartition(1 << 20, "cpu", slab_bytes=1 << 15))
    ref.attach("m", spec)
    remote = pair(host, spec)
    g = torch.Generator().manual_seed(0)
    lens = [5, 9, 13]
    for h, n in enumerate(lens):
        kv = torch.randn(-(-n // 4), 2, 2, 4, 2, 16, generator=g)
        assert remote.load(h, kv, n)
        ref.load("m", h, kv, n)
    assert remote.begin_step([0, 1, 2], lens) == ref.plan("m", [0, 1, 2], lens) == []
    for layer in (0, 1):
        q, k, v = (torch.randn(3, n, 16, generator=g) for n in (4, 2, 2))
        remote.post(layer, q, k, v)
        torch.testing.assert_close(remote.collect(layer), ref.attend("m", layer, q, k, v))
    assert remote.bytes_out > 0 and remote.bytes_in == 2 * 3 * 4 * 16 * 4 and remote.wait_s > 0
    (svc,) = host.services.values()  # before close: an ended service leaves `services` at once
    remote.close()
    assert svc.ended.wait(5) and not host.executor.guests  # the guest's KV went with its pairing


@pytest.mark.parametrize(("ratio", "overlap"), [(0.5, False), (1.0, False), (1.0, True)])
def test_outputs_equal_without_offload(reference: dict[str, list[int]], host: ExecutorHost, ratio: float,
                                       overlap: bool) -> None:
    s = sender(overlap)
    remote = offload_over_gloo(s, host, ratio)
    rs = reqs()
    assert drive(s, rs, host) == reference
    assert not overlap or s.overlapped_steps > 0
    assert sum(r.attention_executor == "host-0" for r in rs) >= int(ratio * len(rs) / 2)
    assert remote.bytes_out > 0 and remote.bytes_in > 0
    deadline = time.monotonic() + 10  # releases are one-way: the service takes the last ones now
    while sum(host.used_tokens().values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(host.used_tokens().values()) == 0  # every request's KV given back
    remote.close()


def test_prefix_hits_and_chunked_prefill(reference: dict[str, list[int]], host: ExecutorHost) -> None:
    s = make_scheduler(chunked_prefill_size=7)
    offload_over_gloo(s, host, 0.5)
    drive(s, reqs(), host)  # warm the prefix cache
    again = reqs()
    assert drive(s, again, host) == reference
    assert sum(r.cached_tokens for r in again) > 0 and any(r.attention_executor for r in again)


def test_preemption_under_kv_pressure(reference: dict[str, list[int]], host: ExecutorHost) -> None:
    s = make_scheduler(max_total_tokens=64)
    offload_over_gloo(s, host, 0.5)
    rs = reqs()
    assert drive(s, rs, host) == reference
    assert s.num_preemptions > 0 and any(r.attention_executor for r in rs)


def test_overlap_with_stops_planned_past_them(host: ExecutorHost) -> None:
    """Requests stop at tokens of their own while the next step is already planned on the host's
    executor: their RELEASE follows that step's exchange, and nothing is out of step there."""
    ps = prompts(LENGTHS)
    full = drive(make_scheduler(), reqs())
    mk = lambda: [Req(f"r{i}", p, greedy(12, stop_token_ids=[full[f"r{i}"][3 + i % 5]]))  # noqa: E731
                  for i, p in enumerate(ps)]
    want = drive(make_scheduler(), mk())
    s = sender(overlap=True)
    offload_over_gloo(s, host, 1.0)
    rs = mk()
    assert drive(s, rs, host) == want
    assert s.overlapped_steps > 0 and any(r.finish_reason.type == "stop" and r.attention_executor for r in rs)  # type: ignore[union-attr]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_full_executor_keeps_requests_local(overlap: bool) -> None:
    host = new_host(budget=40 * 4096)  # room for a few dozen pages of the tiny model
    s = sender(overlap)
    offload_over_gloo(s, host, 1.0)
    rs = reqs(max_new=40)
    assert drive(s, rs, host) == drive(make_scheduler(), reqs(max_new=40))
    assert any(r.attention_executor for r in rs)
    assert any(r.attention_executor is None for r in rs) or s.num_preemptions > 0
    assert not overlap or s.overlapped_steps > 0


def test_an_executor_that_stops_answering_is_lost_within_the_timeout() -> None:
    spec = GuestSpec(KVGeometry(2, 2, 16, 4, torch.float32), 4, 16, 0.25)
    store, listener = open_store("127.0.0.1")
    mute: list[Link] = []  # connects as the host, then never reads a message
    t = threading.Thread(target=lambda: mute.append(Link(store, HOST_RANK, "gloo", torch.device("cpu"), "127.0.0.1")))
    t.start()
    remote = DistRemote.connect(f"127.0.0.1:{store.port}", "gloo", torch.device("cpu"), spec, "mute-0", 1.0)
    t.join()
    t0 = time.monotonic()
    with pytest.raises(ExecutorLost, match="mute-0"):
        remote.begin_step([1], [4])
    assert time.monotonic() - t0 < 3.0
    assert not remote.alive and not remote.load(2, torch.zeros(1, 2, 2, 4, 2, 16), 3)  # stays local now
    mute[0].close()
    listener.close()


def test_a_sender_that_vanishes_has_its_kv_released(host: ExecutorHost) -> None:
    spec = GuestSpec(KVGeometry(2, 2, 16, 4, torch.float32), 4, 16, 0.25)
    remote = pair(host, spec)
    assert remote.load(7, torch.randn(3, 2, 2, 4, 2, 16), 10)
    assert host.used_tokens() == {"tiny": 12}
    (svc,) = host.services.values()
    remote.link.close()  # as a killed process's sockets close: no goodbye
    assert svc.ended.wait(5)
    assert host.used_tokens() == {} and not host.executor.guests and not host.services
    host.executor.check()


_HOST_SCRIPT = """
import sys, time, torch
sys.path[:0] = [{root!r}, {tests!r}]
from test_offload_dist import new_host, open_msg
from sglang_ext.offload.executor import GuestSpec
from sglang_ext.kvcache.pool import KVGeometry
spec = GuestSpec(KVGeometry({layers}, {kv_heads}, {head_dim}, {page}, torch.float32), {q_heads}, {head_dim}, {scale})
print(new_host().open(open_msg(spec))["store"], flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(("after_steps", "overlap"), [(3, False), (10, False), (6, True)])  # decode steps 2..12
def test_two_processes_executor_killed_mid_generation(reference: dict[str, list[int]], after_steps: int,
                                                      overlap: bool) -> None:
    """The executor's process is SIGKILLed mid-generation (with overlap: while a step is in flight):
    the offloaded requests are recomputed locally and every output is unchanged."""
    s = sender(overlap)
    spec = guest_spec(s.runner)  # type: ignore[arg-type]
    g = spec.geometry
    script = _HOST_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"), layers=g.num_layers,
                                 kv_heads=g.num_kv_heads, head_dim=g.head_dim, page=g.page_size,
                                 q_heads=spec.num_q_heads, scale=spec.scale)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()  # type: ignore[union-attr]
        remote = DistRemote.connect(address, "gloo", torch.device("cpu"), spec, "host-0", 5.0)
        s.runner.set_remote(remote)  # type: ignore[attr-defined]
        s.remote_residency.set_sender(RemoteSender(remote, 0.5, s.runner.pool))

        killed = []

        def kill(step: int) -> None:
            if step == after_steps:
                killed.append(step)
                assert s.remote_sender is not None and s.remote_sender.num_remote > 0, "nothing was offloaded yet"
                assert not overlap or (s.overlap is not None and s.overlap.inflight is not None)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)

        t0 = time.monotonic()
        rs = reqs()
        assert drive(s, rs, each=kill) == reference
        assert killed and time.monotonic() - t0 < 30
        assert s.remote_sender is not None and not s.remote_sender.active and not remote.alive and s.num_preemptions > 0
        assert any(r.attention_executor == "host-0" for r in rs)
    finally:
        proc.kill()
        proc.wait(10)


def test_executor_memory_starts_zeroed() -> None:
    """The torch backend reads whole pages and masks what it must not see; a NaN left in recycled
    memory would still poison the output (0 * NaN). Freed NaN-filled memory is what malloc hands
    back next, so this failed (and the full-executor test above diverged) with an uninitialised arena."""
    n = 40 * 4096
    for _ in range(5):
        junk = torch.full((n // 4,), float("nan"))
        del junk
        assert ForeignKVPartition(n, "cpu", slab_bytes=1 << 15).arena.count_nonzero() == 0
