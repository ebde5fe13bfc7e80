"""bench/routing.py's pieces that need no server: the session replay of the Mooncake trace, the report's
cache hit rate, and its command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import routing
from bench.metrics import RequestResult, SloConfig, compute_metrics


def test_session_replay_keeps_whole_sessions_in_trace_order(tmp_path: Path) -> None:
    out, info = routing.session_trace(500, tmp_path)
    rows = [json.loads(line) for line in (out / "mooncake_conversation_trace.jsonl").read_text().splitlines()]
    assert info == {"rows_from": 500, "sessions": 67, "rows": 141} and len(rows) == 141
    keys = [tuple(r["hash_ids"][:2]) for r in rows]
    assert all(keys.count(k) >= 2 for k in keys)  # every row has a sibling: whole sessions only
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)


def test_prefix_cache_hit_rate_counts_what_servers_said() -> None:
    rs = [RequestResult(i, None, 100, 4, 0.0, success=True, output_tokens=4, cached_tokens=c)
          for i, c in enumerate((50, 0, None))]
    m = compute_metrics(rs, 1.0, SloConfig())
    assert m["prefix_cache_hit_rate"] == 0.25  # 50 of the 200 prompt tokens of the two that said


def test_runs_from_the_command_line() -> None:
    args = routing.build_parser().parse_args(["--policies", "round_robin", "--run", "abs2=--routing cache_aware "
                                              "--balance-abs-threshold 2", "--out", "x.json", "--", "--trace",
                                              "mooncake"])
    assert args.run == ["abs2=--routing cache_aware --balance-abs-threshold 2"]
    assert args.serving_args == ["--", "--trace", "mooncake"]
