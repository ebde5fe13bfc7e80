"""--expert-distribution-recorder-mode stat at the model and the worker (no sockets): the counts of a forward
are the reference router's choice, padding rows add nothing, the logits do not change, and the worker's
start / stop / dump turn the always-running counts into records. The HTTP side is
test_expert_distribution_served.py; inside real CUDA graphs, test_gpu_moe.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _batch_util import PagedSeqs
from _tiny import prompts, tiny_config, tiny_moe_config

from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.forward_batch import ForwardMode
from sglang_ext.messages import ExpertDistributionReq
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.expert_counts import ExpertCounts
from sglang_ext.models.moe import SparseMoeBlock
from sglang_ext.ops import moe_route_ref
from sglang_ext.server_args import ServerArgs
from sglang_ext.worker.expert_distribution import ExpertDistributionRecorder, make_recorder

MIXTRAL = tiny_moe_config(num_local_experts=8, num_experts_per_tok=2)
# a dense first layer (mlp_only_layers): the counts' rows are the sparse layers 1 and 2 only
QWEN3 = tiny_moe_config(architectures=["Qwen3MoeForCausalLM"], num_local_experts=16, num_experts_per_tok=4,
                        moe_intermediate_size=32, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[0])


def _runner(cfg: ModelConfig, mode: str | None) -> ModelRunner:
    sa = ServerArgs(device="cpu", dtype="float32", load_format="dummy", page_size=4,
                    expert_distribution_recorder_mode=mode)
    r = ModelRunner(sa, None, cfg)  # type: ignore[arg-type]
    with torch.no_grad():  # the dummy init's 0.02 gives near-uniform router logits; sharpen them
        for p in r.model.parameters():
            if p.dim() >= 2:
                p.mul_(6.0)
    return r


def _block_inputs(r: ModelRunner) -> tuple[list[torch.Tensor], list[Any]]:
    """Hooks that keep each sparse block's input rows and row mask, in layer order."""
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
             for m in r.model.modules() if isinstance(m, SparseMoeBlock)]
    return seen, hooks


def _reference_counts(r: ModelRunner, inputs: list[torch.Tensor], real: torch.Tensor | None) -> torch.Tensor:
    """Per sparse layer, a bincount of the experts the torch reference router picks for the real rows."""
    blocks = [m for m in r.model.modules() if isinstance(m, SparseMoeBlock)]
    rows = []
    for block, x in zip(blocks, inputs, strict=True):
        with torch.no_grad():
            _, ids = moe_route_ref(block.gate(x), block.moe.top_k, block.moe.renormalize)
        if real is not None:
            ids = ids[real]
        rows.append(torch.bincount(ids.flatten().long(), minlength=block.moe.num_experts))
    return torch.stack(rows)


@pytest.mark.parametrize("cfg", [MIXTRAL, QWEN3], ids=["mixtral", "qwen3-moe-dense-first-layer"])
def test_counts_are_the_routers_choice_and_padding_adds_nothing(cfg: ModelConfig) -> None:
    r = _runner(cfg, "stat")
    c = r.expert_counts
    assert c is not None and c.counts.dtype == torch.int64
    moe = cfg.moe
    assert moe is not None
    sparse = tuple(i for i, s in enumerate(moe.sparse_layers) if s)
    assert c.layers == sparse and c.counts.shape == (len(sparse), moe.num_experts) and c.top_k == moe.top_k
    assert not c.counts.any()  # nothing ran yet
    paged = PagedSeqs(r.pool)
    seqs = [paged.new_seq() for _ in range(5)]
    ps = prompts([7, 3, 12, 1, 9], seed=2)
    t = sum(map(len, ps))
    seen, hooks = _block_inputs(r)
    try:
        r.forward(paged.batch(ForwardMode.EXTEND, seqs, ps))
        prefill = c.snapshot()
        assert prefill.sum(dim=1).tolist() == [t * moe.top_k] * len(sparse)
        assert torch.equal(prefill, _reference_counts(r, seen, None))
        assert len(set(prefill.flatten().tolist())) > 2  # a real spread, not one expert per layer
        # a decode batch whose rows 1 and 3 are padding (as a CUDA graph pads): they route to no expert
        seen.clear()
        real = torch.tensor([True, False, True, False, True])
        batch = paged.batch(ForwardMode.DECODE, seqs, [[11], [12], [13], [14], [15]])
        batch.row_mask = real
        r.forward(batch)
    finally:
        for h in hooks:
            h.remove()
    decode = c.snapshot() - prefill
    assert decode.sum(dim=1).tolist() == [3 * moe.top_k] * len(sparse)
    assert torch.equal(decode, _reference_counts(r, seen, real))


def _greedy_logits(r: ModelRunner) -> list[torch.Tensor]:
    paged = PagedSeqs(r.pool, seed=1)
    seqs = [paged.new_seq() for _ in range(3)]
    out = [r.forward(paged.batch(ForwardMode.EXTEND, seqs, prompts([5, 9, 2], seed=4)))]
    for _ in range(4):
        out.append(r.forward(paged.batch(ForwardMode.DECODE, seqs, [[int(t)] for t in out[-1].argmax(-1)])))
    return out


def test_logits_are_bit_identical_with_the_mode_on_and_off() -> None:
    off, on = _runner(QWEN3, None), _runner(QWEN3, "stat")
    assert off.expert_counts is None
    assert all(b.expert_counts is None for b in off.model.modules() if isinstance(b, SparseMoeBlock))
    a, b = _greedy_logits(off), _greedy_logits(on)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert on.expert_counts is not None and int(on.expert_counts.counts[0].sum()) == (16 + 4 * 3) * 4


def test_the_mode_is_validated_and_a_dense_model_refuses_it() -> None:
    with pytest.raises(ValueError, match=r"'per_pass' is not supported \(an SGLang mode.*supported mode is 'stat'"):
        ServerArgs(expert_distribution_recorder_mode="per_pass")
    with pytest.raises(ValueError, match="'zipf' is not supported: the supported mode is 'stat'"):
        ServerArgs(expert_distribution_recorder_mode="zipf")
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(["--expert-distribution-recorder-mode", "stat"])
    assert ServerArgs.from_cli(ns).expert_distribution_recorder_mode == "stat"
    assert ServerArgs().expert_distribution_recorder_mode is None
    sa = ServerArgs(device="cpu", dtype="float32", load_format="dummy", expert_distribution_recorder_mode="stat")
    with pytest.raises(ValueError, match="has no MoE layers"):
        ModelRunner(sa, None, tiny_config())  # type: ignore[arg-type]


def test_a_dense_worker_says_so_at_start() -> None:
    from sglang_ext.worker.tokenizer import StartupError
    from sglang_ext.worker.worker import Worker

    with pytest.raises(StartupError, match=r"--expert-distribution-recorder-mode stat: .* has no MoE layers"):
        Worker(ServerArgs(load_format="dummy", device="cpu", expert_distribution_recorder_mode="stat"))


# ---- the worker's recorder over counts advanced by hand ------------------------------------------------
def _recorder(worker: str = "w-0") -> tuple[ExpertCounts, ExpertDistributionRecorder]:
    counts = ExpertCounts(torch.zeros(2, 4, dtype=torch.int64), (1, 3), 4, 2)
    return counts, ExpertDistributionRecorder(counts, worker, "moe")


def _ask(rec: ExpertDistributionRecorder, action: str, output_dir: str = "") -> Any:
    return rec.handle(ExpertDistributionReq(rid="x", action=action, output_dir=output_dir))  # type: ignore[arg-type]


def _route(counts: ExpertCounts, tokens: int) -> None:
    """`tokens` tokens, each to experts 0 and (its index mod 3) + 1 in both layers."""
    for t in range(tokens):
        counts.counts[:, 0] += 1
        counts.counts[:, t % 3 + 1] += 1


def test_start_stop_dump_record_only_the_window(tmp_path: Path) -> None:
    counts, rec = _recorder()
    assert "not being recorded" in _ask(rec, "stop").data["error"]
    assert "nothing was recorded" in _ask(rec, "dump", str(tmp_path)).data["error"]
    _route(counts, 5)  # before the start: not in the record (graph warm-up, earlier requests)
    assert _ask(rec, "start").ok and rec.recording
    _route(counts, 3)
    stop = _ask(rec, "stop")
    assert stop.ok and "recorded 3 tokens" in stop.data["message"]
    _route(counts, 4)  # after the stop: not in the record either
    dump = _ask(rec, "dump", str(tmp_path / "out"))
    assert dump.ok and dump.data["message"].startswith("w-0: expert distribution written to")
    pt, js = map(Path, dump.data["files"])
    assert pt.parent == tmp_path / "out" and pt.name.startswith("expert_distribution_recorder_w-0_")
    assert pt.suffix == ".pt" and js == pt.with_suffix(".json")
    data = torch.load(pt)
    assert torch.equal(data["logical_count"], torch.tensor([[3, 1, 1, 1], [3, 1, 1, 1]]))
    assert data["logical_count"].dtype == torch.int64
    assert {k: data[k] for k in ("layers", "num_experts", "top_k", "tokens", "model", "worker", "mode")} == {
        "layers": [1, 3], "num_experts": 4, "top_k": 2, "tokens": 3, "model": "moe", "worker": "w-0", "mode": "stat"}
    assert json.loads(js.read_text())["logical_count"] == [[3, 1, 1, 1], [3, 1, 1, 1]]
    # a dump while recording: up to now; the latest output_dir stays where dumps go
    _ask(rec, "start")
    _route(counts, 2)
    again = Path(_ask(rec, "dump").data["files"][0])
    assert again.parent == tmp_path / "out" and again != pt
    assert torch.load(again)["tokens"] == 2 and torch.load(again)["recording"] is True
    assert rec.recording
    # a second start while recording starts afresh
    assert "afresh" in _ask(rec, "start").data["message"]
    assert _ask(rec, "stop").data["message"].endswith("recorded 0 tokens' routing")


def test_the_default_directory_and_an_unwritable_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counts, rec = _recorder()
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path / "env"))
    _ask(rec, "start")
    _route(counts, 1)
    assert Path(_ask(rec, "dump").data["files"][0]).parent == tmp_path / "env"
    bad = _ask(rec, "dump", "/proc/no/such")
    assert not bad.ok and bad.data["status"] == 400 and "output_dir '/proc/no/such'" in bad.data["error"]


def test_without_counts_every_request_says_why() -> None:
    dense = make_recorder(None, False, "w", "llama")
    off = make_recorder(None, True, "w", "mixtral")
    for action in ("start", "stop", "dump"):
        a, b = _ask(dense, action), _ask(off, action)
        assert not a.ok and a.data["status"] == 400 and "model 'llama' has no MoE layers" in a.data["error"]
        assert not b.ok and "start it with --expert-distribution-recorder-mode stat" in b.data["error"]


def test_a_preset_worker_id_makes_a_plain_file_name(tmp_path: Path) -> None:
    """A worker launched with `--model-path preset:NAME` is `preset:NAME-0`: its dump is named
    `..._preset_NAME-0_<ms>` (no ':' or '/', which copy tools and other systems refuse)."""
    counts, rec = _recorder("preset:qwen3/30b-0")
    _ask(rec, "start")
    _route(counts, 2)
    dump = _ask(rec, "dump", str(tmp_path))
    assert dump.ok, dump.data
    pt, js = map(Path, dump.data["files"])
    assert pt.parent == tmp_path and pt.name.startswith("expert_distribution_recorder_preset_qwen3_30b-0_")
    assert pt.exists() and js.exists() and ":" not in js.name
