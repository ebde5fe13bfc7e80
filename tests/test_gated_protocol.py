"""The GPU-signalled exchange's flag protocol (transport/gated.py), checked without a GPU.

The stream operations that the engine's own code enqueues -- `GatedSender.post`/`collect` for the
sender, `GatedProgram._program` for the executor -- are recorded through fake flags, streams and
copies. A model of two GPU streams then plays them: each stream runs its operations in order, a wait
blocks until its flag holds the value, and the streams interleave in every possible way (an exhaustive
search of the reachable states). Over several consecutive steps -- the same recorded operations
repeated, which is what a CUDA graph replay is, mixed with steps recorded anew (eager), row counts
that differ and a step with no remote rows -- it checks that:

- no interleaving deadlocks (a lost signal would leave a wait that nothing satisfies);
- every wait is satisfied by the signal of its own step (a stale or doubly consumed one would be
  another step's), and every read of `exec_in` / `recv` sees the data of its own step and layer;
- between steps (at the end) every flag is 0, and each side resets its flags once per step (one
  fill of its own array, no per-layer reset writes).

Misplaced resets (before the last wait, after the next step's first signal, none at all) are found by
the same search, so the check has teeth; so is the old per-layer reset, as a control. The error paths
are played too: a dead executor whose sender is released by the watchdog's repeated raises, and a
vanished sender whose host drains its queued programs by raising its own doorbells.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import torch

from sglang_ext.offload.program import GatedProgram
from sglang_ext.transport import cuda_signal as cs
from sglang_ext.transport.gated import ExchangeShape, GatedSender

LAYERS = 3
EXEC_IN, RECV = 0x1000, 0x2000  # fake addresses of the executor's input and the sender's output buffers


@dataclass(frozen=True)
class Op:
    """One stream operation: a flag `write`/`wait`/`fill`, a `copy` into a buffer, a `read` of one."""

    kind: str
    target: str  # a flag array or a buffer
    index: int = -1  # the flag (write, wait); -1: the whole array or a buffer
    value: int = 0


@dataclass
class FakeStream:
    name: str
    ops: list[Op] = field(default_factory=list)

    def take(self) -> tuple[Op, ...]:
        out, self.ops = tuple(self.ops), []
        return out


class FakeFlags:
    """cs.FlagArray's stream calls, recorded on the fake stream they are enqueued on."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, n

    def _at(self, i: int) -> int:
        assert 0 <= i < self.n, f"flag {i} of {self.name} out of range"
        return i

    def write(self, stream: FakeStream, i: int, value: int, *, barrier: bool = True) -> None:
        stream.ops.append(Op("write", self.name, self._at(i), value))

    def wait(self, stream: FakeStream, i: int, value: int) -> None:
        stream.ops.append(Op("wait", self.name, self._at(i), value))

    def fill(self, stream: FakeStream, value: int) -> None:
        stream.ops.append(Op("fill", self.name, -1, value))


class FakeBackend:
    """The executor's attention: reads the layer's q|k|v from `exec_in` (recorded as a read)."""

    def __init__(self, stream: FakeStream, hq: int, d: int) -> None:
        self.stream, self.hq, self.d = stream, hq, d

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: Any) -> torch.Tensor:
        self.stream.ops.append(Op("read", "exec_in"))
        return torch.zeros(q.shape[0], self.hq, self.d)


@dataclass
class Pair:
    """One pairing's two ends, built from the engine's classes over fakes, and their recorders."""

    sender: GatedSender
    program: GatedProgram
    s: FakeStream
    x: FakeStream
    backend: FakeBackend
    current: list[FakeStream]  # what the patched torch.cuda.current_stream returns

    def sender_step(self, rows: int) -> tuple[Op, ...]:
        """The sender's operations of one step of `rows` rows (a graph captures exactly these)."""
        sh = self.sender.shape
        self.current[:] = [self.s]
        q, kv = torch.zeros(rows, sh.hq, sh.d), torch.zeros(rows, sh.hkv, sh.d)
        for layer in range(sh.layers):
            self.sender.post(layer, q, kv, kv)
            self.sender.collect(layer)
            self.s.ops.append(Op("read", "recv"))  # the caller scatters the output after collect
        return self.s.take()

    def executor_step(self, rows: int) -> tuple[Op, ...]:
        """The executor's gated program for `rows` (padded) rows."""
        self.program._program(cast(Any, self.backend), rows, cast(Any, None), gated=True)
        return self.x.take()


@pytest.fixture
def make_pair(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Pair]:
    """Pairs whose flags, streams and copies are fakes; everything else is the engine's code."""
    current: list[FakeStream] = []
    names = {EXEC_IN: "exec_in", RECV: "recv"}

    def peer_copy(dst: int, src: int, nbytes: int, stream: FakeStream) -> None:
        stream.ops.append(Op("copy", names[dst]))

    monkeypatch.setattr(cs, "peer_copy", peer_copy)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])

    def make(prefix: str = "") -> Pair:
        shape = ExchangeShape(LAYERS, 2, 1, 4, torch.float32, 8)
        s, x = FakeStream(prefix + "s"), FakeStream(prefix + "x")
        done, bell = FakeFlags(prefix + "done", LAYERS), FakeFlags(prefix + "doorbell", LAYERS)
        monkeypatch.setattr(cs.FlagArray, "allocate", staticmethod(lambda n, device: done))
        sender = GatedSender(shape, torch.device("cpu"))
        sender.attach(EXEC_IN, cast(Any, bell))
        # GatedProgram.__init__ needs an executor and CUDA streams; _program needs only these fields.
        program = GatedProgram.__new__(GatedProgram)
        program.shape, program.stream, program.recv_ptr = shape, cast(Any, x), RECV
        program.doorbell, program.done = cast(Any, bell), cast(Any, done)
        program.exec_in = torch.zeros(shape.max_rows, shape.width_in)
        program.exec_out = torch.zeros(shape.max_rows, shape.width_out)
        return Pair(sender, program, s, x, FakeBackend(x, shape.hq, shape.d), current)

    return make


# ---- the model: streams over shared flags and buffers, every interleaving ----------------------------
ARRAYS = ("done", "doorbell")
BUFFERS = ("exec_in", "recv")
FORGED = -2  # the step a rescuer's raise is attributed to


@dataclass(frozen=True)
class Planned:
    op: Op
    step: int
    layer: int  # the flag's index; for copies and reads, the how-manyth of its kind in the step


def plan(steps: list[tuple[Op, ...]]) -> tuple[Planned, ...]:
    """One stream's whole queue: the steps' operations in order, each with its step and layer."""
    out = []
    for k, ops in enumerate(steps):
        seen: Counter[tuple[str, str]] = Counter()
        for op in ops:
            if op.kind in ("copy", "read"):
                layer = seen[op.kind, op.target]
                seen[op.kind, op.target] += 1
            else:
                layer = op.index
            out.append(Planned(op, k, layer))
    return tuple(out)


Flags = tuple[tuple[int, int], ...]  # per flag: (value, step of the signal that set it)
State = tuple[tuple[int, ...], tuple[Flags, ...], tuple[tuple[int, int] | None, ...]]


@dataclass
class Outcome:
    states: int = 0
    stuck: list[str] = field(default_factory=list)  # reachable states where no stream can move
    violations: set[str] = field(default_factory=set)
    finals: list[tuple[Flags, ...]] = field(default_factory=list)


def explore(queues: dict[str, tuple[Planned, ...]], rescue: tuple[str, str] | None = None,
            check: bool = True) -> Outcome:
    """Play the streams' queues over every interleaving. `rescue` (array, stream): once that stream's
    queue has run (its process is gone), a rescuer -- the watchdog, a host's drain -- raises the whole
    array whenever that changes something. `check`: every wait and read sees its own step's signal
    and data (off when a rescuer forges signals)."""
    names = list(queues)
    progs = [queues[n] for n in names]
    zero: Flags = tuple((0, -1) for _ in range(LAYERS))
    start: State = (tuple(0 for _ in progs), (zero, zero), (None, None))
    seen, todo, out = {start}, [start], Outcome()

    def step(state: State, si: int) -> State | None:
        pcs, flags, bufs = state
        p = progs[si][pcs[si]]
        op, fl, bf = p.op, list(flags), list(bufs)
        if op.kind in ("write", "wait", "fill"):
            a = ARRAYS.index(op.target.rsplit(".", 1)[-1])  # "done", or a pairing's "b.done"
            arr = list(fl[a])
            if op.kind == "wait":
                value, origin = arr[op.index]
                if value != op.value:
                    return None  # blocked
                if check and origin != p.step:
                    out.violations.add(f"{names[si]} step {p.step}: wait on {op.target}[{op.index}] was "
                                       f"satisfied by step {origin}'s signal")
            elif op.kind == "write":
                arr[op.index] = (op.value, p.step)
            else:
                arr = [(op.value, p.step)] * LAYERS
            fl[a] = tuple(arr)
        elif op.kind == "copy":
            bf[BUFFERS.index(op.target)] = (p.step, p.layer)
        else:
            got = bf[BUFFERS.index(op.target)]
            if check and got != (p.step, p.layer):
                out.violations.add(f"{names[si]} step {p.step} layer {p.layer} read {op.target} holding {got}")
        moved = list(pcs)
        moved[si] += 1
        return tuple(moved), tuple(fl), tuple(bf)

    while todo:
        state = todo.pop()
        nexts = [n for si in range(len(progs)) if state[0][si] < len(progs[si]) and (n := step(state, si))]
        if rescue is not None and state[0][names.index(rescue[1])] == len(queues[rescue[1]]):
            fl = list(state[1])
            fl[ARRAYS.index(rescue[0])] = ((1, FORGED),) * LAYERS
            if tuple(fl) != state[1]:
                nexts.append((state[0], tuple(fl), state[2]))
        finished = all(pc == len(p) for pc, p in zip(state[0], progs, strict=True))
        if finished:
            out.finals.append(state[1])
        elif not nexts:
            out.stuck.append(f"stuck at {dict(zip(names, state[0], strict=True))}: " + ", ".join(
                f"{n} waits {progs[i][state[0][i]].op}" for i, n in enumerate(names) if state[0][i] < len(progs[i])))
        for n in nexts:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    out.states = len(seen)
    return out


def all_zero(flags: tuple[Flags, ...]) -> bool:
    return all(v == 0 for arr in flags for v, _ in arr)


def assert_exact(o: Outcome) -> None:
    assert not o.stuck, o.stuck[:3]
    assert not o.violations, sorted(o.violations)[:3]
    assert o.finals and all(all_zero(f) for f in o.finals), "a flag stays raised between steps"


# ---- the engine's protocol ---------------------------------------------------------------------------
def test_each_side_resets_its_own_flags_once_per_step(make_pair: Callable[[str], Pair]) -> None:
    p = make_pair("")
    for rows in (1, 4, 8):
        snd, exe = p.sender_step(rows), p.executor_step(rows)
        for ops, own, other in ((snd, "done", "doorbell"), (exe, "doorbell", "done")):
            kinds = Counter((op.kind, op.target) for op in ops)
            assert kinds["fill", own] == 1 and kinds["fill", other] == 0  # one memset, of its own array
            assert kinds["wait", own] == LAYERS and kinds["write", other] == LAYERS
            assert kinds["write", own] == 0  # no per-layer reset writes
            fill = next(i for i, op in enumerate(ops) if op.kind == "fill")
            last_wait = max(i for i, op in enumerate(ops) if op.kind == "wait")
            assert fill == last_wait + 1  # right after the step's last wait
            assert ops[fill].value == 0
    # Values are baked at capture: a step's operations do not depend on its row count or on which step
    # it is, so a graph captured for one step replays correctly as any later one.
    assert p.sender_step(3) == p.sender_step(4) == p.sender_step(4)
    assert p.executor_step(4) == p.executor_step(8)


def test_consecutive_steps_graph_replays_and_an_empty_step_are_exact(make_pair: Callable[[str], Pair]) -> None:
    p = make_pair("")
    graph_s, graph_x = p.sender_step(4), p.executor_step(4)  # captured once, replayed
    steps_s = [p.sender_step(3), graph_s, (), graph_s, p.sender_step(2)]  # eager, replay, no rows, ...
    steps_x = [p.executor_step(3), graph_x, (), graph_x, p.executor_step(2)]
    queues = {"sender": plan(steps_s), "executor": plan(steps_x)}
    o = explore(queues)
    assert_exact(o)
    # One reachable state per operation: at every point exactly one stream can move. The exchange is
    # lock-step (each side's next signal waits on the other's), which is why no reset can race a
    # signal; the streams' own work between them (attention, local rows) touches no shared memory.
    assert o.states == sum(len(q) for q in queues.values()) + 1


def test_several_senders_touch_only_their_own_flags(make_pair: Callable[[str], Pair]) -> None:
    """A host serving several senders runs one GatedProgram per pairing, with its own doorbells and
    stream, and each sender has its own done flags: no operation of one pairing names another's."""
    a, b = make_pair("a."), make_pair("b.")
    for pair, prefix in ((a, "a."), (b, "b.")):
        ops = pair.sender_step(4) + pair.executor_step(4)
        assert {op.target for op in ops if op.kind in ("write", "wait", "fill")} == {prefix + "done",
                                                                                        prefix + "doorbell"}
    o = explore({"sender": plan([b.sender_step(4)] * 3), "executor": plan([b.executor_step(4)] * 3)})
    assert_exact(o)


# ---- the check has teeth: misplaced resets are found --------------------------------------------------
def _moved_fill(ops: tuple[Op, ...], where: Callable[[list[Op]], int]) -> tuple[Op, ...]:
    """`ops` with its reset moved to index where(ops without it)."""
    fill = next(op for op in ops if op.kind == "fill")
    rest = [op for op in ops if op.kind != "fill"]
    rest.insert(where(rest), fill)
    return tuple(rest)


def _per_layer(ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """The old scheme: no fill; each wait followed by a reset of the flag it consumed."""
    out: list[Op] = []
    for op in ops:
        if op.kind == "fill":
            continue
        out.append(op)
        if op.kind == "wait":
            out.append(Op("write", op.target, op.index, 0))
    return tuple(out)


def _first_write(ops: list[Op]) -> int:
    return next(i for i, op in enumerate(ops) if op.kind == "write") + 1


MUTANTS: dict[str, tuple[Callable[[tuple[Op, ...]], tuple[Op, ...]], Callable[[tuple[Op, ...]], tuple[Op, ...]],
                         str]] = {
    # the executor lowers its doorbells when its program starts: the sender may have rung the first one
    "executor resets at the start": (lambda s: s, lambda x: _moved_fill(x, lambda ops: 0), "stuck"),
    # the sender lowers done after ringing the step's first doorbell: the executor may have answered
    "sender resets after its first ring": (lambda s: _moved_fill(s, _first_write), lambda x: x, "stuck"),
    # no reset on the sender: the next step's waits pass on the last step's signals
    "sender never resets": (lambda s: tuple(op for op in s if op.kind != "fill"), lambda x: x, "violations"),
    # the executor lowers its doorbells before its last wait: a late ring of the step survives it
    "executor resets too early": (lambda s: s, lambda x: _moved_fill(
        x, lambda ops: max(i for i, op in enumerate(ops) if op.kind == "wait")), "stuck"),
    "per-layer resets (the old scheme)": (_per_layer, _per_layer, "exact"),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_misplaced_resets_are_caught(make_pair: Callable[[str], Pair], name: str) -> None:
    p = make_pair("")
    ms, mx, expect = MUTANTS[name]
    o = explore({"sender": plan([ms(p.sender_step(4))] * 3), "executor": plan([mx(p.executor_step(4))] * 3)})
    if expect == "exact":
        assert_exact(o)
    elif expect == "stuck":
        assert o.stuck, f"{name}: no deadlock found"
    else:
        assert o.violations, f"{name}: no stale signal found"


# ---- error paths ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("died_after", [0, 5, 13, 20])
def test_watchdog_releases_every_queued_sender_step_of_a_dead_executor(make_pair: Callable[[str], Pair],
                                                                       died_after: int) -> None:
    """The executor's process died after `died_after` operations of its queue; the sender has three
    steps queued (two under overlap, and one more). The watchdog raises done[*] whenever that changes
    something: the sender's stream drains whatever the interleaving (its results are forged, and
    the pairing ends)."""
    p = make_pair("")
    snd, exe = p.sender_step(4), p.executor_step(4)
    queue_x = plan([exe] * 3)[:died_after]
    o = explore({"sender": plan([snd] * 3), "executor": queue_x}, rescue=("done", "executor"), check=False)
    assert not o.stuck, o.stuck[:3]
    assert o.finals


@pytest.mark.parametrize("sent_layers", [0, 1, LAYERS - 1])
def test_a_host_drains_the_programs_of_a_vanished_sender(make_pair: Callable[[str], Pair], sent_layers: int) -> None:
    """The sender stopped after posting `sent_layers` layers of its second step; the host raises its own
    doorbells until its three queued programs are done (ipc_host.py's drain), then lowers them."""
    p = make_pair("")
    snd, exe = p.sender_step(4), p.executor_step(4)
    per_layer = len(snd) // LAYERS  # post (copy, ring), collect (wait), the caller's read
    queue_s = plan([snd, snd[: per_layer * sent_layers]])
    o = explore({"sender": queue_s, "executor": plan([exe] * 3)}, rescue=("doorbell", "sender"), check=False)
    assert not o.stuck, o.stuck[:3]
    assert o.finals
