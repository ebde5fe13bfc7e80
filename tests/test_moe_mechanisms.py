"""The mechanisms on an MoE model: the tiny engine model as a Mixtral (4 experts, top-2, every layer).
Greedy outputs equal the unconstrained plain loop's with remote attention (offload ratio 0.5 and 1),
preemption under KV pressure, KV rotation under lvf with copies that land late, the overlap loop, and
prefill-to-decode handoff with the KV adopted by the executor (Adrenaline). The expert FFN runs beside
attention, so nothing in these paths may depend on the feed-forward's kind: this checks it does not."""

from __future__ import annotations

from typing import Any

import _tiny
import pytest
from _rotation_util import PAGE, drive, reqs, rotating
from _tiny import VOCAB, greedy, make_scheduler, prompts, run_all, tiny_moe_config

from sglang_ext.models.decoder import DecoderForCausalLM
from sglang_ext.models.moe import SparseMoeBlock
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler

LENGTHS = [5, 17, 33, 9, 40, 3, 21, 12]


@pytest.fixture(autouse=True)
def moe_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every scheduler the helpers build serves the MoE model."""
    monkeypatch.setattr(_tiny, "tiny_config", tiny_moe_config)


def _reqs(max_new: int = 12) -> list[Req]:
    return [Req(f"r{i}", p, greedy(max_new)) for i, p in enumerate(prompts(LENGTHS))]


@pytest.fixture
def reference() -> dict[str, list[int]]:
    s = make_scheduler(max_total_tokens=16384)
    model: Any = s.runner.model
    assert isinstance(model, DecoderForCausalLM) and isinstance(model.layers[0].mlp, SparseMoeBlock)
    return run_all(s, _reqs())


@pytest.mark.parametrize("ratio", [0.5, 1.0])
def test_remote_attention_is_exact(reference: dict[str, list[int]], ratio: float) -> None:
    s = make_scheduler(offload_executor="local", offload_ratio=ratio)
    rs = _reqs()
    assert run_all(s, rs) == reference
    assert any(r.attention_executor for r in rs)
    assert s.remote_sender is not None and s.remote_sender.num_remote == 0


def test_preemption_under_kv_pressure_is_exact(reference: dict[str, list[int]]) -> None:
    s = make_scheduler(max_total_tokens=64)
    assert run_all(s, _reqs()) == reference
    assert s.num_preemptions > 0


def test_rotation_is_exact() -> None:
    want = drive(make_scheduler(page_size=PAGE, max_total_tokens=16384), reqs(prompts(LENGTHS)))
    s, clock = rotating("lvf", late=3, rotation_budget_mb=0.05, max_total_tokens=60)
    assert drive(s, reqs(prompts(LENGTHS)), clock, every=1) == want
    assert s.rot is not None and s.rot.rotations_out >= 2 and s.rot.rotations_in == s.rot.rotations_out


def test_overlap_loop_is_exact(reference: dict[str, list[int]]) -> None:
    other = make_scheduler(max_total_tokens=72)
    ov = Scheduler(other.args, other.runner, other.page_size, other.eos_ids, vocab_size=VOCAB, overlap=True)
    assert run_all(ov, _reqs()) == reference
    assert ov.overlapped_steps > 0


def test_prefill_to_decode_with_adopted_kv_is_exact(reference: dict[str, list[int]]) -> None:
    """A prefill scheduler hands each request off; the decode side gets the KV placed on its executor
    (Adrenaline) for three of them and staged for the rest."""
    from test_adrenaline import decode_with_placed
    from test_adrenaline import drive as drive_pd

    s = make_scheduler(offload_executor="local", offload_ratio=1.0)
    rs = [Req(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts(LENGTHS))]
    out = decode_with_placed(s, rs, {"r0", "r2", "r4"})
    drive_pd(s, out)
    assert out == reference
