"""Child process of tests/test_gpu_gated_exchange.py: one scenario of the engine's GPU-signalled exchange
(offload/peer.py's PeerRemote: transport/gated.py's GatedSender and offload/program.py's GatedProgram in
this process, the sender on cuda:0, the executor on EXECUTOR_DEVICE), in a process of its own so that a
lost signal -- a stream waiting forever -- is killed from outside instead of hanging the test run.
Prints one line per phase and "ok" at the end; any failure raises (the parent shows stderr).

    python tests/_gated_exchange_child.py steps|errors|senders EXECUTOR_DEVICE torch|flashinfer

steps    consecutive steps, eager and replayed from a CUDA graph on both sides (FlashInfer: the
         executor's graph lanes; torch: its eager program), steps without remote rows between them, and
         steps queued back to back with no host synchronisation between them, as serving does: every
         step's output equals an eager reference executor's, and every flag is 0 after each group.
errors   the watchdog releases a sender whose executor never answers (eager and replayed steps queued),
         and a host drains the program of a sender that stopped mid-step (ipc_host.py's drain).
senders  two senders on one executor (two pairings): steps of both queued together stay exact.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from typing import Any, cast

import torch

from sglang_ext.kvcache.pool import KVGeometry
from sglang_ext.offload.executor import AttentionExecutor, GuestSpec
from sglang_ext.offload.ipc_host import IpcHostEnd
from sglang_ext.offload.partition import ForeignKVPartition
from sglang_ext.offload.peer import PeerRemote
from sglang_ext.offload.remote import LocalRemote
from sglang_ext.transport.watchdog import Watchdog

LAYERS, HQ, HKV, D, PAGE = 4, 8, 2, 128, 16  # Llama-3-8B's head shape (group 4, head_dim 128), bf16
GEO = KVGeometry(LAYERS, HKV, D, PAGE, torch.bfloat16)
SPEC = GuestSpec(GEO, HQ, D, D**-0.5)
SENDER = torch.device("cuda:0")
LENGTHS = (37, 5, 70)  # KV tokens of the requests when they are loaded
PAD = 4  # the sender's graphs are captured for 4 rows (3 real, one pad), as the split graphs pad
MAX_STEPS = 32  # tokens every request may grow by (reserved when loaded)
TIMEOUT_S = 60.0
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def log(msg: str) -> None:
    print(msg, flush=True)


def executor(device: torch.device, backend: str) -> AttentionExecutor:
    return AttentionExecutor(ForeignKVPartition(64 << 20, device), backend)


class Pairing:
    """One sender and its executor (the engine's PeerRemote), a reference executor computing the same
    rows eagerly without flags (LocalRemote), the requests loaded into both, and the sender's stream
    with a graph of one whole step captured on it."""

    def __init__(self, ex: AttentionExecutor, backend: str, guest: str, seed: int) -> None:
        self.remote = PeerRemote(ex, guest, SPEC, SENDER, HQ, max_rows=16, executor_id=guest)
        self.ref = LocalRemote(executor(ex.device, backend), guest, SPEC)
        self.s = torch.cuda.Stream(SENDER)
        self.seed = seed
        self.lengths = dict(enumerate(LENGTHS, 1))
        g = torch.Generator().manual_seed(seed)
        for h, n in self.lengths.items():
            kv = torch.randn(-(-n // PAGE), LAYERS, 2, PAGE, HKV, D, generator=g).to(SENDER, torch.bfloat16)
            assert self.remote.load(h, kv, n, reserve_tokens=n + MAX_STEPS), "executor full"
            assert self.ref.load(h, kv, n, reserve_tokens=n + MAX_STEPS), "reference executor full"
        self.q, self.k, self.v = (torch.zeros(LAYERS, PAD, h, D, dtype=torch.bfloat16, device=SENDER)
                                  for h in (HQ, HKV, HKV))
        self.out = torch.zeros(LAYERS, PAD, HQ, D, dtype=torch.bfloat16, device=SENDER)
        self._inputs: list[tuple[str, QKV | None]] = []
        self._queued: list[tuple[str, list[int], list[int], QKV, torch.Tensor]] = []
        self._warm()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.s, capture_error_mode="thread_local"):
            self._layers(self.q, self.k, self.v, self.out)
        for dev in {SENDER, ex.device}:
            torch.cuda.synchronize(dev)  # the KV loads landed before any program reads them

    def _layers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        """The sender's part of a step, on the current stream: post each layer, copy its output out."""
        for layer in range(LAYERS):
            self.remote.post(layer, q[layer], k[layer], v[layer])
            out[layer].copy_(self.remote.collect(layer))

    def _warm(self) -> None:
        """Run the kernels of a step's sender side once, ungated: a kernel's first launch may load its
        module and wait for the GPU to go idle, which it never does while a program waits on a
        doorbell that only this stream will ring (program.py's warm-up does the same for its side)."""
        snd, n = self.remote.sender, len(LENGTHS)
        with torch.cuda.stream(self.s):
            snd.recv.fill_(float("nan"))
            for rows in (n, PAD):
                torch.cat([t[0, :rows].reshape(rows, -1) for t in (self.q, self.k, self.v)], dim=1, out=snd.send[:rows])
                self.out[0, :rows].copy_(snd.recv[:rows].view(rows, HQ, D))
            for t in (self.q, self.k, self.v):
                t[:, :n].copy_(t[:, :n].clone())
                t[:, n:].zero_()
            self.out.zero_()
        self.s.synchronize()

    # ---- steps ------------------------------------------------------------------------------------------
    def prepare(self, modes: list[str], first: int) -> None:
        """Fresh q|k|v for steps first.. (made on the default stream: nothing here waits for the
        sender's stream, so steps queued after it really are back to back)."""
        self._inputs = []
        for i, mode in enumerate(modes):
            g = torch.Generator().manual_seed(1000 * self.seed + first + i)
            q, k, v = (torch.randn(LAYERS, len(LENGTHS), h, D, generator=g).to(SENDER, torch.bfloat16)
                       for h in (HQ, HKV, HKV))
            self._inputs.append((mode, None if mode == "empty" else (q, k, v)))
        self._queued = []

    def queue(self) -> None:
        """Queue the prepared steps on the sender's stream, each planned on the executor first (its
        program queued behind the doorbells), with no host synchronisation between them."""
        self.s.wait_stream(torch.cuda.current_stream(SENDER))  # the inputs
        with torch.cuda.stream(self.s):
            for k, (mode, qkv) in enumerate(self._inputs):
                if qkv is None:  # a step without remote rows: the executor queues nothing, the sender posts nothing
                    assert self.remote.begin_step([], []) == []
                    continue
                handles = list(self.lengths)
                positions = [self.lengths[h] for h in handles]
                n = len(handles)
                self.remote.sender.recv.fill_(float("nan"))  # poison: a read before the executor's push shows
                assert self.remote.begin_step(handles, positions) == []
                if mode == "eager":
                    out = torch.empty(LAYERS, n, HQ, D, dtype=torch.bfloat16, device=SENDER)
                    self._layers(*qkv, out)
                else:
                    for static, fresh in zip((self.q, self.k, self.v), qkv, strict=True):
                        static[:, :n].copy_(fresh)
                        static[:, n:].zero_()
                    self.graph.replay()
                    out = self.out[:, :n].clone()  # the next replay overwrites self.out
                for h in handles:
                    self.lengths[h] += 1
                self._queued.append((f"step {k} ({mode})", handles, positions, qkv, out))

    def verify(self) -> None:
        """After `finish`: every flag is down, and each queued step's output is the reference's."""
        self.check_flags_down()
        for what, handles, positions, (q, k, v), got in self._queued:
            assert not got.isnan().any(), f"{what}: the sender read its output before the executor pushed it"
            assert self.ref.begin_step(handles, positions) == []
            want = torch.stack([self.ref.attend(layer, q[layer], k[layer], v[layer]) for layer in range(LAYERS)])
            try:
                torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
            except AssertionError as e:
                raise AssertionError(f"{what}: {e}") from None

    def check_flags_down(self) -> None:
        done, bell = self.remote.sender.done.read(), self.remote.program.doorbell.read()
        assert done == [0] * LAYERS and bell == [0] * LAYERS, f"flags up between steps: done {done}, doorbell {bell}"

    def streams(self) -> list[torch.cuda.Stream]:
        return [self.s, self.remote.program.stream]


def finish(pairs: list[Pairing], timeout_s: float = TIMEOUT_S) -> None:
    """Wait for every pairing's sender and executor streams; a wait that never ends is a lost signal:
    raise every flag (on side streams) until the streams drain, then fail."""
    events = []
    for p in pairs:
        for s in p.streams():
            e = torch.cuda.Event()
            e.record(s)
            events.append(e)
    deadline = time.monotonic() + timeout_s
    while not all(e.query() for e in events):
        if time.monotonic() > deadline:
            side = {d: torch.cuda.Stream(d) for d in {SENDER, pairs[0].remote.program.dev}}
            for _ in range(5000):
                if all(e.query() for e in events):
                    break
                for p in pairs:
                    p.remote.sender.done.fill(side[SENDER], 1)
                    p.remote.program.doorbell.fill(side[p.remote.program.dev], 1)
                time.sleep(1e-3)
            raise AssertionError(f"a stream still waited on a flag after {timeout_s:g} s: a signal was lost")
        time.sleep(1e-4)


# ---- scenarios --------------------------------------------------------------------------------------------
GROUPS = [["eager"], ["graph"], ["empty"], ["graph", "graph"], ["eager", "graph", "empty", "graph", "eager"],
          ["empty", "eager", "eager"], ["graph", "empty", "empty", "graph"]]


def steps(dev_e: torch.device, backend: str) -> None:
    p = Pairing(executor(dev_e, backend), backend, "g", seed=1)
    first = 0
    for modes in GROUPS:
        p.prepare(modes, first)
        p.queue()
        finish([p])
        p.verify()
        first += len(modes)
        log(f"steps {modes}: exact, flags down")


def senders(dev_e: torch.device, backend: str) -> None:
    ex = executor(dev_e, backend)
    a, b = Pairing(ex, backend, "a", seed=1), Pairing(ex, backend, "b", seed=2)
    first = 0
    for modes_a, modes_b in [(["eager"], ["graph"]), (["graph", "graph"], ["graph", "eager"]),
                             (["empty", "graph"], ["graph", "empty"])]:
        a.prepare(modes_a, first)
        b.prepare(modes_b, first)
        a.queue()
        b.queue()  # both pairings' steps in flight together, on one executor
        finish([a, b])
        a.verify()
        b.verify()
        first += 2
        log(f"senders {modes_a} / {modes_b}: exact, flags down")


def errors(dev_e: torch.device, backend: str) -> None:
    # A dead executor: the sender's steps are queued with no program behind its doorbells; the
    # watchdog (offload/ipc.py's) raises the completion flags until the sender's stream drains.
    p = Pairing(executor(dev_e, backend), backend, "g", seed=1)
    rescue = torch.cuda.Stream(SENDER)
    snd = p.remote.sender
    with torch.cuda.stream(p.s):
        out = torch.empty(LAYERS, len(LENGTHS), HQ, D, dtype=torch.bfloat16, device=SENDER)
        p._layers(p.q[:, :3], p.k[:, :3], p.v[:, :3], out)
        p.graph.replay()
        p.graph.replay()
        p._layers(p.q[:, :3], p.k[:, :3], p.v[:, :3], out)
    drained = torch.cuda.Event()
    drained.record(p.s)
    wd = Watchdog(lambda: "the executor is gone (test)", lambda: snd.done.fill(rescue, 1), name="test")
    wd.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not drained.query() and time.monotonic() < deadline:
        time.sleep(1e-3)
    wd.stop()
    wd.join(5.0)
    assert drained.query(), "the watchdog did not release the sender's stream"
    assert wd.releases >= 1
    log(f"errors: the watchdog released 4 queued steps ({wd.releases} raises)")
    for flags in (snd.done, p.remote.program.doorbell):  # the pairing is over; clean up for the next part
        flags.fill(rescue, 0)
    rescue.synchronize()

    # A sender that stops after two of its step's layers: the host raises its own doorbells until the
    # program is done (ipc_host.py's drain), and lowers them. The half step leaves the sender's flags
    # raised, which is why a pairing that lost a step ends.
    with torch.cuda.stream(p.s):
        assert p.remote.begin_step(list(p.lengths), list(p.lengths.values())) == []
        for layer in range(2):
            p.remote.post(layer, p.q[layer, :3], p.k[layer, :3], p.v[layer, :3])
            p.remote.collect(layer)
    host = cast(Any, SimpleNamespace(program=p.remote.program))
    assert IpcHostEnd.drain(host, timeout_s=TIMEOUT_S), "the host's drain did not finish the program"
    finish([p])
    assert p.remote.program.idle()
    torch.cuda.synchronize(dev_e)  # the drain's last fill (lowering the doorbells) is on a stream of its own
    assert p.remote.program.doorbell.read() == [0] * LAYERS
    assert snd.done.read() == [1] * LAYERS
    log("errors: the host drained the program of a sender that stopped mid-step")


def main(argv: list[str]) -> None:
    scenario, dev_e, backend = argv[0], torch.device(argv[1]), argv[2]
    torch.cuda.set_device(SENDER)
    if len(argv) > 3:  # executor_max_sms: every program from here on runs in a green context of that many SMs
        from sglang_ext.engine import sm_partition

        got = sm_partition.cap_executor(dev_e, int(argv[3]))
        assert got >= int(argv[3]), got
        log(f"executor capped at {got} SMs")
    {"steps": steps, "senders": senders, "errors": errors}[scenario](dev_e, backend)
    print("ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
