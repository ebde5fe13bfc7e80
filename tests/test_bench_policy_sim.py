"""bench/policy_sim.py: the real scheduler on a synthetic GPU clock (a smoke run, and the clock's rules)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.policy_sim import GPUCost, main
from sglang_ext.forward_batch import ForwardMode


def test_cost_model_charges_context_for_decode_rows_and_tokens_for_prefill() -> None:
    c = GPUCost()

    class B:  # the cost model reads only a batch's extend_lens and seq_lens
        def __init__(self, ext: list[int], seq: list[int]) -> None:
            self.extend_lens, self.seq_lens, self.mode = ext, seq, ForwardMode.DECODE

    one, two = c.forward(B([1], [1000])), c.forward(B([1, 1], [1000, 9000]))  # type: ignore[arg-type]
    assert abs((two - one) - (c.row_s + c.ctx_s * 9000)) < 1e-12
    pre = c.forward(B([4000], [4000]))  # type: ignore[arg-type]
    assert pre > c.step_s + 4000 * c.prefill_s


def test_smoke_sweep_writes_a_report(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    assert main(["--runs", "fcfs-recompute", "lvf-rotate", "--rates", "2", "--seconds", "3", "--max-in", "512",
                 "--max-out", "8", "--pool-tokens", "4096", "--out", str(out)]) == 0
    points = json.loads(out.read_text())["points"]
    assert [p["run"] for p in points] == ["fcfs-recompute", "lvf-rotate"]
    for p in points:
        assert p["scheduled"] == 8 and 0 < p["finished"] <= 8 and 0.0 <= p["attainment"] <= 1.0
