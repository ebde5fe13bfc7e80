"""The worker's step profile (`--step-log-interval-s`): one line per interval with the interval's means."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from sglang_ext.server_args import ServerArgs
from sglang_ext.worker.step_log import StepLog, make_step_log


def test_the_interval_argument_turns_it_on() -> None:
    assert make_step_log(ServerArgs(), "w0") is None  # off by default: nothing is measured
    log = make_step_log(ServerArgs(step_log_interval_s=5.0), "w0")
    assert log is not None and (log.interval_s, log.name) == (5.0, "w0")
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="step_log_interval_s"):
            ServerArgs(step_log_interval_s=bad)


def test_a_line_per_interval_with_the_means(caplog: pytest.LogCaptureFixture) -> None:
    remote = SimpleNamespace(wait_s=0.0, staged_loads=0)
    sched = SimpleNamespace(running=[1, 2, 3, 4], waiting=[1, 2], overlapped_steps=0, forward_rows=0,
                            remote_sender=SimpleNamespace(num_remote=2, remote=remote))
    log = StepLog(interval_s=0.0, name="w0")  # every step closes an interval
    with caplog.at_level(logging.INFO, logger="sglang_ext.worker.step_log"):
        log.record(sched, 0.010, tokens_out=4, prefill_tokens=0)  # the baseline for the counters
        sched.overlapped_steps, remote.staged_loads, sched.forward_rows = 1, 3, 3  # one request sat out
        log.record(sched, 0.020, tokens_out=4, prefill_tokens=512)
    line = caplog.messages[-1]
    assert line.startswith("w0: steps 1 (") and "20.0 ms mean" in line and "100 % with a prefill" in line
    assert "100 % overlapped" in line and "running 4.0 (remote 2.0) waiting 2.0 | rows 3.0" in line
    assert "(loads 3)" in line and "with remote rows" not in line  # no remote rows were planned


def test_steps_with_remote_rows_are_timed_apart(caplog: pytest.LogCaptureFixture) -> None:
    remote = SimpleNamespace(wait_s=0.0, staged_loads=0)
    sched = SimpleNamespace(running=[1, 2], waiting=[], overlapped_steps=0, forward_rows=0, remote_forward_rows=0,
                            remote_sender=SimpleNamespace(num_remote=1, remote=remote))
    log = StepLog(interval_s=3600.0, name="w0")
    with caplog.at_level(logging.INFO, logger="sglang_ext.worker.step_log"):
        for wall, remote_rows in ((0.010, 1), (0.012, 1), (0.004, 0), (0.014, 2)):
            sched.remote_forward_rows += remote_rows
            log.record(sched, wall, tokens_out=2, prefill_tokens=0)
        log._emit(sched, 1.0)  # type: ignore[arg-type]
    assert caplog.messages[-1].endswith("| with remote rows 3 x 12.0 ms, without 1 x 4.0 ms")


def test_the_pool_and_the_decode_only_steps(caplog: pytest.LogCaptureFixture) -> None:
    """KV in use after each step (mean and peak share of the pool) and the steps without a prefill apart:
    their time and rows are what the simulator's decode step is checked against in serving."""
    alloc = SimpleNamespace(capacity=100, num_free=50)
    sched = SimpleNamespace(running=[1, 2, 3], waiting=[], overlapped_steps=0, forward_rows=0, forward_context=0,
                            remote_sender=None, allocator=alloc)
    log = StepLog(interval_s=3600.0, name="w0")
    with caplog.at_level(logging.INFO, logger="sglang_ext.worker.step_log"):
        for wall, rows, prefill, free, context in ((0.100, 4, 2048, 50, 8192), (0.010, 3, 0, 40, 3000),
                                                   (0.014, 3, 0, 10, 3030)):
            sched.forward_rows += rows
            sched.forward_context += context  # the KV tokens the step's rows attended over
            alloc.num_free = free
            log.record(sched, wall, tokens_out=rows, prefill_tokens=prefill)
        log._emit(sched, 1.0)  # type: ignore[arg-type]
    line = caplog.messages[-1]
    assert "| kv 67 % mean, 90 % peak |" in line  # (50 + 60 + 90) / 3 and 90
    assert "| decode-only forwards 2 x 12.0 ms at 3.0 rows of 1005 tokens |" in line  # 6030 tokens over 6 rows
    # the forward with a prefill apart: its call's time, its prompt tokens and all its rows
    assert line.endswith("| prefill forwards 1 x 100.0 ms of 2048 tokens at 4.0 rows")


def test_a_call_that_only_lands_a_step_adds_its_time_to_that_forward(caplog: pytest.LogCaptureFixture) -> None:
    """Outside the overlap loop's steady state a launched decode step lands one call later, in a call that
    launches nothing: a forward's time is both calls', and rows count per forward, not per call."""
    sched = SimpleNamespace(running=[1, 2, 3], waiting=[], overlapped_steps=0, forward_rows=0, forward_context=0,
                            remote_sender=None)
    log = StepLog(interval_s=3600.0, name="w0")
    with caplog.at_level(logging.INFO, logger="sglang_ext.worker.step_log"):
        # (wall, new rows, prefill tokens): a prefill run at once, then two decode steps launched and landed
        # a call later, then one overlapped pair (each call launches one and lands the one before)
        for wall, rows, prefill in ((0.100, 3, 2048), (0.002, 3, 0), (0.010, 0, 0), (0.003, 3, 0), (0.011, 0, 0),
                                    (0.013, 3, 0), (0.013, 3, 0)):
            sched.forward_rows += rows
            sched.forward_context += rows * 1000
            log.record(sched, wall, tokens_out=rows, prefill_tokens=prefill)
        log._emit(sched, 1.0)  # type: ignore[arg-type]
    line = caplog.messages[-1]
    assert "steps 7 (" in line and "| rows 3.0 |" in line  # 15 rows over 5 forwards, not 7 calls
    assert "| decode-only forwards 4 x 13.0 ms at 3.0 rows of 1000 tokens |" in line  # (12 + 14 + 13 + 13) / 4
    assert line.endswith("| prefill forwards 1 x 100.0 ms of 2048 tokens at 3.0 rows")


def test_the_overlap_loops_calls_that_only_land_count_with_their_forward() -> None:
    """The real overlap loop (on CPU) has calls that launch nothing; the profile counts its forwards."""
    from _tiny import EOS, VOCAB, greedy, make_scheduler

    from sglang_ext.scheduler.request import Req
    from sglang_ext.scheduler.scheduler import Scheduler

    base = make_scheduler(step_log_interval_s=60.0)
    s = Scheduler(base.args, base.runner, base.page_size, frozenset([EOS]), vocab_size=VOCAB, overlap=True)
    s.add_request(Req("a", [5, 6, 7, 8, 9], greedy(6)))
    s.add_request(Req("b", [5, 6, 7, 9], greedy(3)))
    log = StepLog(interval_s=3600.0, name="w0")
    calls: list[tuple[int, int]] = []  # (new rows, prefill tokens) per call
    while s.has_work():
        rows, pre = s.forward_rows, s.prefill_tokens
        s.step()
        log.record(s, 0.001, tokens_out=0, prefill_tokens=s.prefill_tokens - pre)
        calls.append((s.forward_rows - rows, s.prefill_tokens - pre))
        if len(calls) == 4:
            s.add_request(Req("c", [4, 6, 7, 9, 11, 12], greedy(3)))  # a queue: the next call only lands
    decode = [n for n, p in calls if n and not p]
    assert any(n == 0 for n, _ in calls) and s.overlap is not None and s.overlap.overlapped_steps > 0
    w = log._w
    assert (w.decode_steps, w.decode_rows) == (len(decode), sum(decode))  # forwards, not calls
    landing_only = sum(1 for n, p in calls if not n and not p)
    assert w.decode_wall_s == pytest.approx(0.001 * (len(decode) + landing_only))


def test_the_scheduler_counts_rows_and_their_context() -> None:
    """The real scheduler's counters that the profile reads: one prefill forward of a 5-token prompt,
    then decode forwards whose one row attends over 6, 7, ... tokens (its context after the step)."""
    from _tiny import greedy, make_scheduler

    from sglang_ext.scheduler.request import Req

    s = make_scheduler(step_log_interval_s=60.0)  # the context is counted for a step profile only
    s.add_request(Req("r", [5, 6, 7, 8, 9], greedy(4)))
    seen = []
    while s.has_work():
        s.step()
        seen.append((s.forward_rows, s.forward_context))
    assert seen[:4] == [(1, 5), (2, 11), (3, 18), (4, 26)]


def test_the_scheduler_counts_prompt_chunks_and_the_keys_they_attend_over() -> None:
    """A prompt prefilled in chunks, then one that shares its first pages through the prefix cache: the
    chunks' causal query-key pairs count every key a computed prompt token attends over, the cached
    prefix included (what prices a chunk's attention after a prefix), and nothing for a cached token."""
    from _tiny import greedy, make_scheduler, prompts

    from sglang_ext.scheduler.request import Req

    s = make_scheduler(step_log_interval_s=60.0, chunked_prefill_size=4)
    (p,) = prompts([10])
    a = Req("a", p, greedy(2))
    s.add_request(a)
    while s.has_work():
        s.step()
    assert s.prefill_chunks == 3  # 4 + 4 + 2 tokens; their context after each: 4, 8, 10
    assert s.prefill_pairs == sum(range(1, 11)) and s.prefill_chunk_context == 4 + 8 + 10
    before = (s.prefill_chunks, s.prefill_pairs)
    b = Req("b", [*p[:8], 3, 4, 5], greedy(2))
    s.add_request(b)
    while s.has_work():
        s.step()
    assert b.cached_tokens > 0  # its first pages came from the prefix cache
    computed = range(b.cached_tokens, 11)  # positions of the prompt tokens it forwarded
    assert s.prefill_pairs - before[1] == sum(i + 1 for i in computed)
    assert s.prefill_chunks - before[0] == -(-len(computed) // 4)


def test_prefill_forwards_log_their_chunks_keys_and_riding_rows(caplog: pytest.LogCaptureFixture) -> None:
    """The prefill segment ends with how many chunks a forward held, the keys a prompt token attended over
    and the decode rows riding along with their context (the rows that are not chunks)."""
    sched = SimpleNamespace(running=[1, 2, 3], waiting=[], overlapped_steps=0, forward_rows=0, forward_context=0,
                            prefill_chunks=0, prefill_chunk_context=0, prefill_pairs=0, remote_sender=None)
    log = StepLog(interval_s=3600.0, name="w0")
    with caplog.at_level(logging.INFO, logger="sglang_ext.worker.step_log"):
        # one forward: a 1,000-token chunk after a 3,000-token prefix beside two decode rows at 500 tokens
        sched.forward_rows, sched.forward_context = 3, 4000 + 2 * 500
        sched.prefill_chunks, sched.prefill_chunk_context = 1, 4000
        sched.prefill_pairs = 1000 * 3000 + 1000 * 1001 // 2
        log.record(sched, 0.080, tokens_out=3, prefill_tokens=1000)
        log._emit(sched, 1.0)  # type: ignore[arg-type]
    assert caplog.messages[-1].endswith("| prefill forwards 1 x 80.0 ms of 1000 tokens at 3.0 rows "
                                        "(1.0 chunks, 3500 keys a prompt token; 2.0 decoding at 500 tokens)")


def test_why_steps_were_not_overlapped_ends_the_line(caplog: pytest.LogCaptureFixture) -> None:
    """The overlap loop's reasons for running a step plain, counted per interval (the first line is the
    baseline); the knee's step profile still reads the line."""
    from bench import step_profile

    sched = SimpleNamespace(running=[1, 2], waiting=[], overlapped_steps=0, forward_rows=0, forward_context=0,
                            remote_sender=None, not_overlapped={"rows": 4, "landed": 0, "queue": 1})
    log = StepLog(interval_s=0.0, name="w0")
    with caplog.at_level(logging.INFO, logger="sglang_ext.worker.step_log"):
        log.record(sched, 0.010, tokens_out=2, prefill_tokens=0)
        sched.not_overlapped = {"rows": 6, "landed": 3, "queue": 1}
        sched.forward_rows, sched.forward_context = 2, 1000
        log.record(sched, 0.010, tokens_out=2, prefill_tokens=0)
        log.record(sched, 0.010, tokens_out=2, prefill_tokens=0)  # nothing new: no reasons
    first, second, third = caplog.messages
    assert "not overlapped" not in first and "not overlapped" not in third
    assert second.endswith("| not overlapped: rows 2, landed 3")
    assert step_profile._LINE.search(second) is not None
