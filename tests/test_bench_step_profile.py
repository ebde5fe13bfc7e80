"""bench/step_profile.py reads the worker's step-profile lines (sglang_ext/worker/step_log.py) between the
knee search's point markers: the lines are made here by the real StepLog, so a change of its format
breaks this test rather than the GPU run's analysis."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import step_profile as S
from sglang_ext.worker.step_log import StepLog


def _lines(caplog: pytest.LogCaptureFixture, steps: list[tuple[float, int, int, int]]) -> list[str]:
    """One profile line per (wall s, rows, prefill tokens, free pages of 100) step; each row attends over
    500 tokens."""
    alloc = SimpleNamespace(capacity=100, num_free=100)
    sched = SimpleNamespace(running=[1, 2], waiting=[1], overlapped_steps=0, forward_rows=0, forward_context=0,
                            remote_sender=None, allocator=alloc)
    log = StepLog(interval_s=0.0, name="w0")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang_ext.worker.step_log"):
        for wall, rows, prefill, free in steps:
            sched.forward_rows += rows
            sched.forward_context += 500 * rows
            alloc.num_free = free
            log.record(sched, wall, tokens_out=rows, prefill_tokens=prefill)  # type: ignore[arg-type]
    return [f"[w0] INFO sglang_ext.worker.step_log: {m}" for m in caplog.messages]


def test_points_are_the_lines_between_their_markers(caplog: pytest.LogCaptureFixture) -> None:
    before = _lines(caplog, [(0.010, 2, 0, 90)])  # a warm-up step outside any point
    first = _lines(caplog, [(0.100, 2, 4096, 60), (0.010, 2, 0, 50), (0.020, 2, 0, 20)])
    second = _lines(caplog, [(0.030, 4, 0, 0)])
    text = "\n".join([*before, f"{S.POINT_MARK} begins 2.5 0", *first, f"{S.POINT_MARK} ends 2.5 0",
                      "[sglang_ext] something else", f"{S.POINT_MARK} begins 3 1", *second,
                      f"{S.POINT_MARK} ends 3 1", f"{S.POINT_MARK} begins 4 0", f"{S.POINT_MARK} ends 4 0"])
    pts = S.parse_log(text, "lvf-rotate")
    assert [(p.rate, p.repeat) for p in pts] == [(2.5, 0), (3.0, 1)]  # 4 logged no line: left out
    a, b = pts
    # the first line of a fresh StepLog has no baseline for its rows; decode-only steps 2 and 3
    assert a.steps == 3 and a.kv_peak == pytest.approx(0.8)
    assert a.kv_mean == pytest.approx((40 + 50 + 80) / 300, abs=0.01)
    assert a.decode_steps == 2 and a.decode_ms == pytest.approx(15.0) and a.decode_context == pytest.approx(500)
    assert b.kv_peak == 1.0 and b.decode_ms == pytest.approx(30.0) and b.waiting == 1.0


def _old(overlapped: int, d_ms: float, d_rows: float) -> str:
    """A line as servers before 2026-12-06 session 5 wrote it: calls counted, no context a row."""
    return (f"[w0] INFO x: w0: steps 100 (50.0/s, 20.0 ms mean, 10 % with a prefill, {overlapped} % overlapped) | "
            "running 12.0 (remote 0.0) waiting 0.5 | rows 12.0 | tokens out 600/s, prefill 9000/s | executor wait "
            f"0.0 % (loads 0) | kv 40 % mean, 70 % peak | decode-only 90 x {d_ms} ms at {d_rows} rows")


def test_a_line_of_an_older_server_has_no_context() -> None:
    """Servers before 2026-12-06 session 5 logged no context a row: the point reads 0, not an error."""
    (p,) = S.parse_log(f"{S.POINT_MARK} begins 3 0\n{_old(100, 11.0, 12.0)}\n{S.POINT_MARK} ends 3 0", "fcfs-recompute")
    assert p.decode_rows == 12.0 and p.decode_context == 0.0 and p.decode_source == S.OLDER


def test_an_older_logs_decode_steps_come_from_its_overlapped_intervals_only() -> None:
    """Before 2026-12-06 session 6 servers counted calls, and a call that only landed a launched step
    counted as a decode-only step of no rows: only wholly overlapped intervals (a forward a call) are read
    for decode; the point's other means keep every interval. Newer lines ("forwards") are read whole."""
    text = "\n".join([f"{S.POINT_MARK} begins 3 0", _old(100, 20.0, 14.0), _old(0, 11.0, 7.0), _old(60, 15.0, 10.0),
                      f"{S.POINT_MARK} ends 3 0"])
    (p,) = S.parse_log(text, "lvf-rotate")
    assert (p.decode_steps, p.decode_ms, p.decode_rows) == (90, 20.0, 14.0) and p.intervals == 3
    newer = _old(0, 22.0, 28.0).replace("decode-only 90", "decode-only forwards 45")
    (q,) = S.parse_log(f"{S.POINT_MARK} begins 3 0\n{newer}\n{S.POINT_MARK} ends 3 0", "lvf-rotate")
    assert (q.decode_steps, q.decode_ms, q.decode_rows, q.decode_source) == (45, 22.0, 28.0, "forwards")


def test_a_folder_with_no_profile_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gp_server_fcfs-recompute.log").write_text(f"{S.POINT_MARK} begins 2 0\n{S.POINT_MARK} ends 2 0\n")
    assert S.main([str(tmp_path)]) == 1 and "no step profile" in capsys.readouterr().err
    assert math.isnan(S._summary("r", 1, 0, [{**dict.fromkeys(
        ("steps", "per_s", "ms", "prefill_pct", "running", "waiting", "rows", "tok_s", "prefill_s", "kv_mean",
         "kv_peak", "d_ms", "d_rows", "per_forward", "overlapped"), 1.0), "d_steps": 0.0}]).decode_ms)


def test_forwards_with_a_prefill_are_estimated_from_what_the_decode_only_ones_leave() -> None:
    """Per interval logged per forward: the forwards that launched a prefill (the logged share of the calls),
    their mean time (the interval's time less its decode-only forwards') and prefill tokens, with the
    interval's decode rows and context beside them; an older line (no context) gives none."""
    line = ("[w0] INFO x: w0: steps 10 (5.0/s, 200.0 ms mean, 20 % with a prefill, 50 % overlapped) | running 21.0 "
            "(remote 0.0) waiting 0.5 | rows 20.0 | tokens out 100/s, prefill 6000/s | executor wait 0.0 % (loads 0) "
            "| kv 40 % mean, 70 % peak | decode-only forwards 8 x 25.0 ms at 20.0 rows of 3000 tokens")
    (p,) = S.parse_log(f"{S.POINT_MARK} begins 2 0\n{line}\n{S.POINT_MARK} ends 2 0", "lvf-rotate")
    # 10 calls in 2 s: 2 with a prefill, which took what the 8 decode-only forwards (200 ms) left of 2,000 ms,
    # and the 12,000 prefill tokens of those 2 s
    assert p.prefill_intervals == ((2, 900.0, 6000.0, 20.0, 3000.0, 1.0, 3000.5),)
    (q,) = S.parse_log(f"{S.POINT_MARK} begins 3 0\n{_old(100, 11.0, 12.0)}\n{S.POINT_MARK} ends 3 0", "lvf-rotate")
    assert q.prefill_intervals == ()


def test_why_steps_were_not_overlapped_is_summed_over_the_point(caplog: pytest.LogCaptureFixture) -> None:
    """The reasons the real StepLog ends its lines with (since 2026-12-07) are summed per point; a line
    without them (every step overlapped, or an older server) adds nothing."""
    alloc = SimpleNamespace(capacity=100, num_free=50)
    sched = SimpleNamespace(running=[1], waiting=[], overlapped_steps=0, forward_rows=0, forward_context=0,
                            remote_sender=None, allocator=alloc, not_overlapped={"rows": 0, "queue": 0})
    log = StepLog(interval_s=0.0, name="w0")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang_ext.worker.step_log"):
        for why in ({"rows": 2, "queue": 0}, {"rows": 5, "queue": 4}, {"rows": 5, "queue": 4}):
            sched.forward_rows += 1
            sched.forward_context += 500
            sched.not_overlapped = why
            log.record(sched, 0.01, tokens_out=1, prefill_tokens=0)  # type: ignore[arg-type]
    lines = [f"[w0] INFO sglang_ext.worker.step_log: {m}" for m in caplog.messages]
    assert "not overlapped" not in lines[0] and "not overlapped" not in lines[-1]
    (p,) = S.parse_log("\n".join([f"{S.POINT_MARK} begins 2 0", *lines, f"{S.POINT_MARK} ends 2 0"]), "lvf-rotate")
    assert p.not_overlapped == {"rows": 3, "queue": 4} and p.intervals == 3
    assert "rows 3, queue 4" in S.format_table([p])
    (q,) = S.parse_log(f"{S.POINT_MARK} begins 3 0\n{_old(100, 11.0, 12.0)}\n{S.POINT_MARK} ends 3 0", "x")
    assert q.not_overlapped == {}


def test_forwards_with_a_prefill_are_read_as_the_server_timed_them() -> None:
    """Servers since 2026-12-07 session 15 time their forwards with a prefill: the line's own count, time
    and prompt tokens replace the estimate (which here would read 2 forwards of 900 ms)."""
    line = ("[w0] INFO x: w0: steps 10 (5.0/s, 200.0 ms mean, 20 % with a prefill, 50 % overlapped) | running 21.0 "
            "(remote 0.0) waiting 0.5 | rows 20.0 | tokens out 100/s, prefill 6000/s | executor wait 0.0 % (loads 0) "
            "| kv 40 % mean, 70 % peak | decode-only forwards 8 x 25.0 ms at 20.0 rows of 3000 tokens "
            "| prefill forwards 3 x 610.5 ms of 4000 tokens at 9.0 rows | not overlapped: queue 2")
    (p,) = S.parse_log(f"{S.POINT_MARK} begins 2 0\n{line}\n{S.POINT_MARK} ends 2 0", "lvf-rotate")
    # one chunk from its prompt's start assumed (no chunk split before session 16): 8 riding rows
    assert p.prefill_intervals == ((3, 610.5, 4000.0, 8.0, 3000.0, 1.0, 2000.5),)
    assert p.decode_ms == 25.0 and p.not_overlapped == {"queue": 2}
    # since session 16 the line says how many chunks, the keys a prompt token attended over, and the rows riding
    (q,) = S.parse_log(f"{S.POINT_MARK} begins 2 0\n" + line.replace(
        "at 9.0 rows |", "at 9.0 rows (2.0 chunks, 3100 keys a prompt token; 7.0 decoding at 2900 tokens) |")
        + f"\n{S.POINT_MARK} ends 2 0", "lvf-rotate")
    assert q.prefill_intervals == ((3, 610.5, 4000.0, 7.0, 2900.0, 2.0, 3100.0),)


def test_the_real_step_log_s_chunk_split_is_read_back(caplog: pytest.LogCaptureFixture) -> None:
    """The line the real StepLog writes for a forward with a chunk after a prefix parses to its figures."""
    sched = SimpleNamespace(running=[1, 2, 3], waiting=[], overlapped_steps=0, forward_rows=0, forward_context=0,
                            prefill_chunks=0, prefill_chunk_context=0, prefill_pairs=0, remote_sender=None,
                            allocator=SimpleNamespace(capacity=100, num_free=50))
    log = StepLog(interval_s=3600.0, name="w0")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang_ext.worker.step_log"):
        sched.forward_rows, sched.forward_context = 2, 500  # a decode forward first (the line needs its context)
        log.record(sched, 0.010, tokens_out=2, prefill_tokens=0)  # type: ignore[arg-type]
        sched.forward_rows, sched.forward_context = 5, 500 + 4000 + 2 * 501
        sched.prefill_chunks, sched.prefill_chunk_context, sched.prefill_pairs = 1, 4000, 1000 * 3000 + 500_500
        log.record(sched, 0.080, tokens_out=3, prefill_tokens=1000)  # type: ignore[arg-type]
        log._emit(sched, 1.0)  # type: ignore[arg-type]
    lines = [f"[w0] INFO sglang_ext.worker.step_log: {m}" for m in caplog.messages]
    (p,) = S.parse_log("\n".join([f"{S.POINT_MARK} begins 2 0", *lines, f"{S.POINT_MARK} ends 2 0"]), "x")
    assert p.prefill_intervals == ((1, 80.0, 1000.0, 2.0, 501.0, 1.0, 3500.0),)
