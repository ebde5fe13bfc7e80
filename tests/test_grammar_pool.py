"""The grammar compile pool (issue 22): a small constraint never waits for large ones, the size and
time limits fail only their own request (and a later request works), the cache answers at once, and
the queue and the abandoned threads are bounded. Orderings are checked with events, never with
wall-clock thresholds: a compile stand-in blocks on a gate the test opens (the `timeout=` of a wait
only keeps a broken pool from hanging the test). Then the same with xgrammar on the embedded model's
tokenizer, and end to end through a worker's server loop."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_worker import InProcessWorker

from sglang_ext.grammar.backend import Constraint, GrammarBackend
from sglang_ext.grammar.pool import SMALL_BYTES, CompilePool, GrammarBusy
from sglang_ext.messages import ErrorOut, GenerateReq, TokenOut
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.default_model import ensure_default_model
from sglang_ext.sampling.params import InvalidRequest, SamplingParams
from sglang_ext.server_args import ServerArgs
from sglang_ext.worker.tokenizer import Tokenizer
from sglang_ext.worker.worker import Worker

WAIT = 60.0  # seconds before a wait is a failure (never reached when the pool works)
SMALL = Constraint("regex", "[a-z]{3}")


def large(tag: str) -> Constraint:
    return Constraint("json_schema", json.dumps({"description": tag + " " + "x" * SMALL_BYTES}))


class Stand:
    """A compile stand-in: records the order compiles start and end; a constraint in `gated` blocks
    until the test opens the gate."""

    def __init__(self, gated: set[Constraint] | None = None) -> None:
        self.gated = gated or set()
        self.gate = threading.Event()
        self.started: dict[Constraint, threading.Event] = {}
        self.order: list[tuple[str, Constraint]] = []
        self.lock = threading.Lock()

    def began(self, c: Constraint) -> threading.Event:
        with self.lock:
            return self.started.setdefault(c, threading.Event())

    def __call__(self, c: Constraint) -> str:
        with self.lock:
            self.order.append(("start", c))
        self.began(c).set()
        if c in self.gated:
            assert self.gate.wait(WAIT)
        with self.lock:
            self.order.append(("end", c))
        return f"compiled {c.kind} {len(c.text)}"


def until(cond: Callable[[], bool]) -> None:
    """Wait for a state the pool reaches on its own threads (a compile that was let go ending)."""
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def pool(stand: Stand, **kw: Any) -> CompilePool[str]:
    return CompilePool(stand, **{"workers": 1, "timeout_s": WAIT, **kw})


def test_small_constraint_does_not_wait_for_large_ones() -> None:
    """Issue 22's case: four large schemas arrive, then a small regex. With two threads for any size
    both are busy with large ones and two more are queued; the regex is compiled and answered while
    they still compile."""
    bigs = [large(str(i)) for i in range(4)]
    stand = Stand(set(bigs))
    p = pool(stand, workers=2)
    futs = [p.submit(c) for c in bigs]
    assert stand.began(bigs[0]).wait(WAIT) and stand.began(bigs[1]).wait(WAIT)
    assert stand.order == [("start", bigs[0]), ("start", bigs[1])] or \
        stand.order == [("start", bigs[1]), ("start", bigs[0])]
    assert p.queued == 2
    assert p.submit(SMALL).result(WAIT) == f"compiled regex {len(SMALL.text)}"
    assert not any(f.done() for f in futs)  # every large one still compiling or queued
    assert ("end", SMALL) in stand.order and not any(e == "end" for e, c in stand.order if c != SMALL)
    stand.gate.set()
    assert all(f.result(WAIT).startswith("compiled json_schema") for f in futs)
    p.close()


def test_small_ones_go_first_on_the_shared_threads() -> None:
    """Queued small constraints are taken before queued large ones, which keep their arrival order."""
    hold, b1, b2 = large("hold"), large("1"), large("2")
    stand = Stand({hold})
    p = pool(stand, workers=1)
    first = p.submit(hold)
    assert stand.began(hold).wait(WAIT)
    later = [p.submit(c) for c in (b1, Constraint("regex", "a"), b2, Constraint("regex", "b"))]
    for f in later[1::2]:
        f.result(WAIT)  # the reserved small thread compiles them meanwhile
    stand.gate.set()
    for f in [first, *later]:
        f.result(WAIT)
    ends = [c for e, c in stand.order if e == "end" and c.kind == "json_schema"]
    assert ends == [hold, b1, b2]
    p.close()


def test_cache_hit_is_answered_at_once_and_skips_compiling() -> None:
    stand = Stand()
    p = pool(stand, cache_size=2)
    a, b, c = Constraint("regex", "a"), Constraint("regex", "b"), Constraint("regex", "c")
    first = p.submit(a).result(WAIT)
    hit = p.submit(a)
    assert hit.done() and hit.result() is first and p.compiles == 1  # no queue, no thread, no compile
    p.submit(b).result(WAIT)
    p.submit(a).result(WAIT)  # a is now the most recently used
    p.submit(c).result(WAIT)  # evicts b, the least recently used
    assert p.cached(a) and p.cached(c) and not p.cached(b) and p.compiles == 3
    p.submit(b).result(WAIT)
    assert p.compiles == 4
    p.close()


def test_concurrent_requests_for_one_constraint_compile_it_once() -> None:
    big = large("same")
    stand = Stand({big})
    p = pool(stand)
    futs = [p.submit(big) for _ in range(5)]
    assert stand.began(big).wait(WAIT)
    stand.gate.set()
    assert len({f.result(WAIT) for f in futs}) == 1 and p.compiles == 1
    p.close()


def test_oversized_constraint_is_refused_before_compiling() -> None:
    stand = Stand()
    p = pool(stand, max_bytes=100)
    with pytest.raises(InvalidRequest, match=r"sampling_params.json_schema is 4\d\d\d bytes; .* at most 100 bytes "
                                             r"\(--grammar-max-bytes\)"):
        p.submit(large("x"))
    assert p.submit(Constraint("regex", "é" * 50)).result(WAIT)  # 100 bytes in UTF-8: at the limit
    with pytest.raises(InvalidRequest, match="is 102 bytes"):
        p.submit(Constraint("regex", "é" * 51))
    assert p.compiles == 1 and p.threads == 2  # the limit is checked before anything is queued
    p.close()


def test_timeout_fails_the_request_and_a_later_request_works() -> None:
    hang = large("hang")
    stand = Stand({hang})
    p = pool(stand, timeout_s=0.2)
    with pytest.raises(InvalidRequest, match=r"sampling_params.json_schema did not compile within 0.2 s "
                                             r"\(--grammar-compile-timeout-s\)"):
        p.submit(hang).result(WAIT)
    assert p.abandoned == 1 and p.threads == 2  # abandoned, and replaced
    # a large constraint after it compiles on the replacement (the abandoned thread is still stuck)
    assert p.submit(large("ok")).result(WAIT).startswith("compiled") and not stand.gate.is_set()
    # the same constraint again fails at once: it does not take a second thread
    again = p.submit(hang)
    assert again.done() and isinstance(again.exception(), InvalidRequest)
    compiles = p.compiles
    stand.gate.set()  # the abandoned compile ends: its grammar is cached, its thread leaves the pool
    until(lambda: p.abandoned == 0)
    assert p.compiles == compiles + 1 and p.cached(hang) and p.threads == 2
    assert p.submit(hang).done()
    p.close()


def test_abandoned_threads_are_bounded_and_small_ones_keep_working() -> None:
    hangs = [large(f"hang{i}") for i in range(3)]
    stand = Stand(set(hangs))
    p = pool(stand, workers=1, timeout_s=0.2)
    for c in hangs[:2]:
        with pytest.raises(InvalidRequest, match="did not compile within"):
            p.submit(c).result(WAIT)
    # the first was replaced; the second not (at most `workers` abandoned): no thread for large ones
    assert p.abandoned == 2 and p.threads == 1
    waiting = p.submit(hangs[2])
    assert p.submit(SMALL).result(WAIT)  # the small thread is untouched
    with pytest.raises(GrammarBusy, match=r"waited 0.2 s for a grammar compile thread"):
        waiting.result(WAIT)
    stand.gate.set()  # the abandoned ones finish: one rejoins the pool, the other ends
    until(lambda: p.abandoned == 0)
    assert p.threads == 2
    assert p.submit(large("after")).result(WAIT)
    p.close()


def test_queue_is_bounded_and_cache_hits_still_answer() -> None:
    hold = large("hold")
    stand = Stand({hold})
    p = pool(stand, queue_size=2)
    p.submit(SMALL).result(WAIT)
    first = p.submit(hold)
    assert stand.began(hold).wait(WAIT)
    queued = [p.submit(large("q1")), p.submit(large("q2"))]
    with pytest.raises(GrammarBusy, match=r"2 large constraints are waiting to compile "
                                          r"\(--grammar-compile-queue-size\)"):
        p.submit(large("q3"))
    assert p.submit(SMALL).done()  # cached: never queued
    assert p.submit(Constraint("regex", "new")).result(WAIT)  # small ones have their own queue
    stand.gate.set()
    for f in [first, *queued]:
        f.result(WAIT)
    p.close()


def test_cancelled_waiters_do_not_cancel_others_and_unwanted_jobs_are_skipped() -> None:
    hold, big = large("hold"), large("big")
    stand = Stand({hold})
    p = pool(stand)
    p.submit(hold)
    assert stand.began(hold).wait(WAIT)
    mine, theirs = p.submit(big), p.submit(big)
    assert mine.cancel()  # an asyncio waiter cancelled (wrap_future cancels its concurrent future)
    alone = p.submit(large("alone"))
    assert alone.cancel()
    stand.gate.set()
    assert theirs.result(WAIT)
    p.close()
    assert large("alone") not in [c for _, c in stand.order]  # nobody wanted it any more


# ---- xgrammar -------------------------------------------------------------------------------------------
def _nested(depth: int, width: int) -> dict[str, Any]:
    if depth == 0:
        return {"type": "string", "pattern": "^[a-z]{1,8}$"}
    keys = [f"k{depth}_{i}" for i in range(width)]
    return {"type": "object", "properties": {k: _nested(depth - 1, width) for k in keys}, "required": keys,
            "additionalProperties": False}


BIG_SCHEMA = json.dumps(_nested(3, 5))  # ~10 KB, nested: a large constraint


@pytest.fixture(scope="module")
def tok_env() -> tuple[Tokenizer, ModelConfig]:
    d = ensure_default_model()
    return Tokenizer.from_dir(d), ModelConfig.from_path(d)


def test_xgrammar_regex_compiles_while_a_big_schema_compiles(tok_env: tuple[Tokenizer, ModelConfig]) -> None:
    """Real compiles: the big schema's compile is held at its start until the regex is compiled."""
    tok, cfg = tok_env
    g = GrammarBackend(tok.hf, cfg.vocab_size, cfg.eos_token_ids, workers=1)
    big = Constraint("json_schema", BIG_SCHEMA)
    assert len(BIG_SCHEMA) > SMALL_BYTES
    started, gate = threading.Event(), threading.Event()
    real = g._compile_here

    def held(c: Constraint) -> Any:
        if c == big:
            started.set()
            assert gate.wait(WAIT)
        return real(c)

    g.pool._compile = held
    pending = g.submit(big)
    assert started.wait(WAIT)
    regex = g.submit(Constraint("regex", r"[0-9]{3}-[a-z]{2}")).result(WAIT)
    assert not pending.done()
    state = g.state(regex)
    for t in tok.hf.encode("123-ab", add_special_tokens=False):
        state.accept(t)
    assert state.error is None and state.matcher.accept_token(cfg.eos_token_ids[0])  # the match is complete
    gate.set()
    assert g.state(pending.result(WAIT)).live
    with pytest.raises(InvalidRequest, match="--grammar-max-bytes"):
        GrammarBackend(tok.hf, cfg.vocab_size, cfg.eos_token_ids, max_bytes=1000).submit(big)
    g.pool.close()


# ---- through a worker's server loop --------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessWorker]:
    args = ServerArgs(device="cpu", dtype="float32", page_size=4, max_total_tokens=8192,
                      grammar_compile_workers=1, grammar_compile_timeout_s=5.0, grammar_max_bytes=20000)
    w = InProcessWorker(Worker(args), tmp_path_factory.mktemp("grammar"))
    yield w
    w.stop()
    assert w.code == 0


def _gen(rid: str, **constraint: str) -> GenerateReq:
    return GenerateReq(rid=rid, text="Record: ", sampling_params=SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                               **constraint))


def _hold(worker: Worker, text: str) -> tuple[threading.Event, threading.Event]:
    """Hold the compile of `text` at its start until the returned gate is set."""
    assert worker.grammars is not None
    p = worker.grammars.pool
    real, started, gate = p._compile, threading.Event(), threading.Event()

    def held(c: Constraint) -> Any:
        if c.text == text:
            started.set()
            assert gate.wait(WAIT)
        return real(c)

    p._compile = held
    return started, gate


def _stopped(out: Any) -> bool:
    return isinstance(out, TokenOut) and out.finished and out.meta_info["finish_reason"]["type"] == "stop"


def test_served_small_request_finishes_while_a_big_schema_compiles(served: InProcessWorker) -> None:
    started, gate = _hold(served.worker, BIG_SCHEMA)
    served.send(_gen("big", json_schema=BIG_SCHEMA))
    assert started.wait(WAIT)
    served.send(_gen("small", regex="[0-9]{3}"))
    [(_, small)] = served.until_done({"small"})
    assert _stopped(small) and small.meta_info["completion_tokens"] <= 4  # three digits (one token each) + end
    gate.set()
    [(_, big)] = served.until_done({"big"})
    assert isinstance(big, TokenOut) and big.finished
    assert not served.worker.compiled_grammars  # each compiled grammar was taken by its request


def test_served_limits_answer_through_the_error_path(served: InProcessWorker) -> None:
    slow = BIG_SCHEMA.replace("k1_", "s1_")
    _, gate = _hold(served.worker, slow)
    served.send(_gen("huge", json_schema=json.dumps({"description": "x" * 20000})))
    served.send(_gen("slow", json_schema=slow))
    ended = dict(served.until_done({"huge", "slow"}))
    assert isinstance(ended["huge"], ErrorOut) and ended["huge"].status == 400
    assert "at most 20000 bytes (--grammar-max-bytes)" in ended["huge"].message
    assert isinstance(ended["slow"], ErrorOut) and ended["slow"].status == 400
    assert "did not compile within 5 s" in ended["slow"].message
    served.send(_gen("after", regex="(yes|no)"))  # a later request works
    [(_, after)] = served.until_done({"after"})
    assert _stopped(after)
    gate.set()
