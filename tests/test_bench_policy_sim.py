"""bench/policy_sim.py: the real scheduler on a synthetic GPU clock (a smoke run, and the clock's rules)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.policy_sim import forward_seconds, main
from bench.sim.cost import CostModel
from sglang_ext.forward_batch import ForwardMode


def test_cost_model_charges_context_for_decode_rows_and_tokens_for_prefill() -> None:
    c = CostModel.load()  # the calibrated H200 file, Llama-3-8B geometry
    d = c.cal.decode

    class B:  # the cost model reads only a batch's extend_lens and seq_lens
        def __init__(self, ext: list[int], seq: list[int]) -> None:
            self.extend_lens, self.seq_lens, self.mode = ext, seq, ForwardMode.DECODE

    one, two = forward_seconds(c, B([1], [1000])), forward_seconds(c, B([1, 1], [1000, 9000]))  # type: ignore[arg-type]
    kv_s = 9000 * c.kv_bytes_per_token / (d["kv_GBps"] * 1e9)  # type: ignore[operator]
    assert abs((two - one) - (d["row_us"] * 1e-6 + kv_s)) < 1e-9  # type: ignore[operator]
    pre = forward_seconds(c, B([4000], [4000]))  # type: ignore[arg-type]
    assert pre > 10 * one  # 4000 prompt tokens are compute-bound: tens of ms against a ~5 ms decode step


def test_smoke_sweep_writes_a_report(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    assert main(["--runs", "fcfs-recompute", "lvf-rotate", "--rates", "2", "--seconds", "3", "--max-in", "512",
                 "--max-out", "8", "--pool-tokens", "4096", "--out", str(out)]) == 0
    points = json.loads(out.read_text())["points"]
    assert [p["run"] for p in points] == ["fcfs-recompute", "lvf-rotate"]
    for p in points:
        assert p["scheduled"] == 8 and 0 < p["finished"] <= 8 and 0.0 <= p["attainment"] <= 1.0
