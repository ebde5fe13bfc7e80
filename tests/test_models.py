"""Model families against HF `transformers` (CPU, float32), the default model, and the presets."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _batch_util import PagedSeqs, make_pool_and_backend, run_logits

from sglang_ext.configs import preset_config_file, preset_dir, preset_names
from sglang_ext.forward_batch import ForwardMode
from sglang_ext.models import model_class as model_class_for
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.decoder import DecoderForCausalLM
from sglang_ext.models.default_model import ensure_default_model
from sglang_ext.models.loader import load_model
from sglang_ext.models.resolve import resolve_model_path

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB = 256
PROMPT_LEN = 20
PREFILL_LEN = 15

_SMALL: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
    pad_token_id=None,  # no eos: generate() must run the full length
)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0,
                                      tie_word_embeddings=False)),
    # old context 64 puts RoPE wavelengths in all three bands of the llama3 rescaling
    "llama3-rope": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})),
    "mistral-gqa": ("MistralConfig", dict(num_attention_heads=8, num_key_value_heads=2, sliding_window=None,
                                          rope_theta=1e6)),
    "qwen2-bias-tied": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=True)),
    "qwen3-qknorm": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         tie_word_embeddings=False)),
    # MoE: small expert counts so each prompt hits several experts and some expert none on a token
    "mixtral-moe": ("MixtralConfig", dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                          num_experts_per_tok=2, sliding_window=None, rope_theta=1e6)),
    # shared expert and its sigmoid gate, QKV bias, unnormalized top-k, a dense layer (mlp_only_layers)
    "qwen2-moe-shared": ("Qwen2MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, num_experts=6,
                                                num_experts_per_tok=2, moe_intermediate_size=32,
                                                shared_expert_intermediate_size=48, norm_topk_prob=False,
                                                mlp_only_layers=[1], tie_word_embeddings=False)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                                         num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                                         tie_word_embeddings=False)),
}


def _hf_model(family: str) -> Any:
    cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**_SMALL, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32,
                                                          attn_implementation="eager")
    # HF's init leaves biases at 0 and norms at 1, which would hide a mis-mapped bias or norm;
    # std 0.1 (vs 0.02) makes logits peaked enough that greedy decoding has no near-ties.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model.eval()


@pytest.fixture(scope="module", params=[*FAMILIES, "llama-mha-sharded"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, DecoderForCausalLM]:
    """(HF model, our model loaded from the HF model's safetensors save)."""
    family = request.param.removesuffix("-sharded")
    hf = _hf_model(family)
    d = tmp_path_factory.mktemp(request.param)
    shard = "40KB" if request.param.endswith("-sharded") else "10GB"
    hf.save_pretrained(d, safe_serialization=True, max_shard_size=shard)
    if request.param.endswith("-sharded"):
        assert (d / "model.safetensors.index.json").exists() and len(list(d.glob("*.safetensors"))) > 2
    cfg = ModelConfig.from_path(d)
    ours = load_model(d, cfg, "auto", torch.float32, torch.device("cpu"))
    return hf, ours


def _prompt(seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_logits_match_hf(pair: tuple[Any, DecoderForCausalLM]) -> None:
    hf, ours = pair
    ids = _prompt()
    pool, backend = make_pool_and_backend(ours.cfg)
    seqs = PagedSeqs(pool)
    batch = seqs.batch(ForwardMode.EXTEND, [seqs.new_seq()], [ids], all_logits=True)
    torch.testing.assert_close(run_logits(ours, backend, batch), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_incremental_decode_matches_hf(pair: tuple[Any, DecoderForCausalLM]) -> None:
    hf, ours = pair
    ids = _prompt(1)
    ref = _hf_logits(hf, ids)
    pool, backend = make_pool_and_backend(ours.cfg)
    seqs = PagedSeqs(pool)
    seq = seqs.new_seq()
    batch = seqs.batch(ForwardMode.EXTEND, [seq], [ids[:PREFILL_LEN]], all_logits=True)
    torch.testing.assert_close(run_logits(ours, backend, batch), ref[:PREFILL_LEN], atol=ATOL, rtol=0)
    for p in range(PREFILL_LEN, PROMPT_LEN):
        batch = seqs.batch(ForwardMode.DECODE, [seq], [[ids[p]]])
        torch.testing.assert_close(run_logits(ours, backend, batch)[0], ref[p], atol=ATOL, rtol=0)


def test_chunked_prefill_matches_hf(pair: tuple[Any, DecoderForCausalLM]) -> None:
    """Extend batches on top of a cached prefix (chunked prefill / prefix-cache hit)."""
    hf, ours = pair
    ids = _prompt(5)
    ref = _hf_logits(hf, ids)
    pool, backend = make_pool_and_backend(ours.cfg, page_size=3)
    seqs = PagedSeqs(pool)
    seq = seqs.new_seq()
    for lo, hi in [(0, 7), (7, 8), (8, PROMPT_LEN)]:
        batch = seqs.batch(ForwardMode.EXTEND, [seq], [ids[lo:hi]], all_logits=True)
        assert batch.seq_lens == [hi] and batch.extend_lens == [hi - lo]
        torch.testing.assert_close(run_logits(ours, backend, batch), ref[lo:hi], atol=ATOL, rtol=0)


def test_greedy_matches_hf_generate(pair: tuple[Any, DecoderForCausalLM]) -> None:
    hf, ours = pair
    ids, steps = _prompt(2)[:12], 8
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, min_new_tokens=0)
    expected = out[0, len(ids):].tolist()
    pool, backend = make_pool_and_backend(ours.cfg)
    seqs = PagedSeqs(pool)
    seq = seqs.new_seq()
    logits = run_logits(ours, backend, seqs.batch(ForwardMode.EXTEND, [seq], [ids]))
    got: list[int] = []
    for _ in range(steps):
        got.append(int(logits[0].argmax()))
        logits = run_logits(ours, backend, seqs.batch(ForwardMode.DECODE, [seq], [[got[-1]]]))
    assert got == expected


def test_mixed_batches_match_hf(pair: tuple[Any, DecoderForCausalLM]) -> None:
    """Two requests of different lengths share one extend batch, then decode together."""
    hf, ours = pair
    a, b = _prompt(3), _prompt(4)[:9]
    ref_a, ref_b = _hf_logits(hf, a), _hf_logits(hf, b)
    pool, backend = make_pool_and_backend(ours.cfg)
    seqs = PagedSeqs(pool, seed=5)
    sa, sb = seqs.new_seq(), seqs.new_seq()
    got = run_logits(ours, backend, seqs.batch(ForwardMode.EXTEND, [sa, sb], [a[:14], b[:6]]))
    torch.testing.assert_close(got, torch.stack([ref_a[13], ref_b[5]]), atol=ATOL, rtol=0)
    for i in range(3):
        batch = seqs.batch(ForwardMode.DECODE, [sa, sb], [[a[14 + i]], [b[6 + i]]])
        got = run_logits(ours, backend, batch)
        torch.testing.assert_close(got, torch.stack([ref_a[14 + i], ref_b[6 + i]]), atol=ATOL, rtol=0)


# ---- the embedded default model ------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


def test_default_model_build_is_deterministic(default_dir: Path, tmp_path: Path) -> None:
    again = ensure_default_model(tmp_path)
    names = sorted(p.name for p in default_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for n in names:
        assert (default_dir / n).read_bytes() == (again / n).read_bytes(), n


def test_default_model_concurrent_builds(tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_default_model(tmp_path)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    # only the finished directory remains: no leftover temporary build directories
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]
    assert ModelConfig.from_path(results[0]).num_layers > 0


def test_default_model_tokenizer(default_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(default_dir)
    cfg = ModelConfig.from_path(default_dir)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.vocab_size == len(tok)
    assert cfg.num_kv_heads < cfg.num_heads  # GQA
    assert tok.bos_token == "<|begin_of_text|>" and tok.eos_token == "<|end_of_text|>"
    assert cfg.bos_token_id == tok.bos_token_id and tok.eos_token_id in cfg.eos_token_ids
    assert tok.convert_tokens_to_ids("<|im_end|>") in cfg.eos_token_ids
    for text in ["Hello, world!", "  two  spaces\tand a tab\nnew line", "naïve café — 42 ☕ 日本"]:
        ids = tok(text).input_ids
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids.count(tok.bos_token_id) == 1


def test_default_model_matches_hf_and_is_peaked(default_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(default_dir)
    ids = tok("On a quiet morning the baker opened her shop and counted the change.").input_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_dir, torch_dtype=torch.float32).eval()
    ours = load_model(default_dir, ModelConfig.from_path(default_dir), "auto", torch.float32,
                      torch.device("cpu"))
    pool, backend = make_pool_and_backend(ours.cfg, page_size=16)
    seqs = PagedSeqs(pool)
    got = run_logits(ours, backend, seqs.batch(ForwardMode.EXTEND, [seqs.new_seq()], [ids], all_logits=True))
    ref = _hf_logits(hf, ids)
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-4)
    top2 = ref.topk(2, dim=-1).values
    assert ref.std() > 2.0 and (top2[:, 0] - top2[:, 1]).median() > 0.2


# ---- presets and path resolution --------------------------------------------------------------
KNOWN_PARAMS = {
    "llama-3-8b": 8.03e9,
    "llama-3.2-1b": 1.236e9,
    "mistral-7b": 7.25e9,
    "qwen2.5-7b": 7.62e9,
    "qwen2.5-32b": 32.76e9,
    "qwen3-8b": 8.19e9,
    "mixtral-8x7b": 46.7e9,  # Mistral's figure; 12.9B active
    "qwen3-30b-a3b": 30.5e9,  # Qwen's figure; 3.3B active
}


def test_preset_names() -> None:
    assert preset_names() == sorted(KNOWN_PARAMS)


@pytest.mark.parametrize("name", sorted(KNOWN_PARAMS))
def test_preset_geometry(name: str, tmp_path: Path) -> None:
    cfg = ModelConfig.from_dict(json.loads(preset_config_file(name).read_text()))
    assert cfg.num_params() == pytest.approx(KNOWN_PARAMS[name], rel=0.01)
    d = preset_dir(name, cache_dir=tmp_path)
    assert [p.name for p in d.iterdir()] == ["config.json"]
    assert ModelConfig.from_path(d) == cfg
    assert preset_dir(name, cache_dir=tmp_path) == d  # second call reuses it


def test_preset_details() -> None:
    def load(name: str) -> ModelConfig:
        return ModelConfig.from_dict(json.loads(preset_config_file(name).read_text()))

    small = load("llama-3.2-1b")
    assert small.tie_word_embeddings and (small.rope_scaling or {}).get("rope_type") == "llama3"
    assert load("mistral-7b").sliding_window is None and load("mistral-7b").vocab_size == 32768
    assert load("qwen2.5-7b").attention_bias and load("qwen2.5-7b").sliding_window is None
    q3 = load("qwen3-8b")
    assert q3.qk_norm and q3.head_dim == 128 and not q3.attention_bias


def test_resolve_model_path(default_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_EXT_CACHE", str(default_dir.parent))
    assert resolve_model_path(None) == default_dir
    d = resolve_model_path("preset:llama-3-8b")
    assert d.parent.parent == default_dir.parent and (d / "config.json").is_file()
    assert resolve_model_path(str(default_dir)) == default_dir
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ValueError, match="unknown preset"):
        resolve_model_path("preset:gpt-5")


# ---- startup costs ----------------------------------------------------------------------------------
def test_dummy_weights_are_deterministic_per_seed() -> None:
    cfg = ModelConfig.from_dict({**_SMALL, "architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4,
                                 "num_key_value_heads": 2})  # Qwen2: q/k/v biases are drawn too
    cpu = torch.device("cpu")
    a, b, c = (load_model(None, cfg, "dummy", torch.float32, cpu, seed=s) for s in (1, 1, 2))  # type: ignore[arg-type]
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["embed_tokens.weight"], sc["embed_tokens.weight"])
    bias = next(k for k in sa if k.endswith("bias"))
    assert sa[bias].abs().sum() > 0 and all(torch.all(v == 1) for k, v in sa.items() if "norm" in k)
    std = sa["embed_tokens.weight"].std().item()
    assert 0.015 < std < 0.025


def test_uninitialised_pool_keeps_page_zero_zeroed() -> None:
    from sglang_ext.kvcache.pool import KVGeometry, KVPool

    geom = KVGeometry(2, 2, 8, 4, torch.float32)
    pool = KVPool(geom, 8, "cpu", zero_fill=False)
    assert torch.count_nonzero(pool.data[0]) == 0
    assert torch.count_nonzero(KVPool(geom, 8, "cpu").data) == 0  # the default (torch backend): all zeros


# ---- MoE: checkpoint layouts, a split by expert, presets -------------------------------------------
def test_moe_presets_active_parameters() -> None:
    def load(name: str) -> ModelConfig:
        return ModelConfig.from_dict(json.loads(preset_config_file(name).read_text()))

    mix, q3 = load("mixtral-8x7b"), load("qwen3-30b-a3b")
    assert mix.moe is not None and (mix.moe.num_experts, mix.moe.top_k, mix.moe.renormalize) == (8, 2, True)
    assert q3.moe is not None and (q3.moe.num_experts, q3.moe.top_k, q3.moe.renormalize) == (128, 8, True)
    assert q3.qk_norm and all(q3.moe.sparse_layers)
    assert mix.active_params() == pytest.approx(12.9e9, rel=0.01)
    assert q3.active_params() == pytest.approx(3.3e9, rel=0.02)
    dense = load("llama-3-8b")
    assert dense.moe is None and dense.active_params() == dense.num_params()


def test_moe_sparse_layers_follow_mlp_only_layers_and_sparse_step() -> None:
    base = {**_SMALL, "architectures": ["Qwen2MoeForCausalLM"], "num_attention_heads": 4, "num_hidden_layers": 6,
            "num_experts": 4, "moe_intermediate_size": 16}
    cfg = ModelConfig.from_dict({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.moe is not None and cfg.moe.sparse_layers == (False, True, False, False, False, True)
    assert cfg.attention_bias and not cfg.moe.renormalize  # Qwen2-MoE: QKV bias, top-k as routed
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.from_dict({**base, "num_experts": 0})


def _hf_moe_dir(tmp_path: Path, family: str) -> tuple[Any, Path]:
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf, tmp_path


@pytest.mark.parametrize("family", ["mixtral-moe", "qwen2-moe-shared"])
def test_moe_loads_stacked_expert_names(family: str, tmp_path: Path) -> None:
    """transformers v5 keeps experts stacked in memory (`mlp.experts.gate_up_proj` [E, 2I, H]); a
    checkpoint written from its state dict loads to the same weights as the per-expert files."""
    from safetensors.torch import save_file

    hf, d = _hf_moe_dir(tmp_path / "per-expert", family)
    per_expert = load_model(d, ModelConfig.from_path(d), "auto", torch.float32, torch.device("cpu"))
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((d / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(stacked / "model.safetensors"))
    assert any("experts.gate_up_proj" in k for k in hf.state_dict())
    again = load_model(stacked, ModelConfig.from_path(stacked), "auto", torch.float32, torch.device("cpu"))
    a, b = per_expert.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_moe_split_by_expert_loads_its_slice(tmp_path: Path) -> None:
    """A model holding experts 2..3 of 4 (a later expert-parallel split) loads the same checkpoint,
    skips the others, and holds exactly the full model's slice: the loader's names do not change."""
    from sglang_ext.models.moe import Experts

    _, d = _hf_moe_dir(tmp_path, "mixtral-moe")
    cfg = ModelConfig.from_path(d)
    full = load_model(d, cfg, "auto", torch.float32, torch.device("cpu"))
    half = model_class_for(cfg)(cfg)
    assert cfg.moe is not None
    for layer in half.layers:
        layer.mlp.experts = Experts(cfg.hidden_size, cfg.moe, first_expert=2, num_local=2)
    from sglang_ext.models.loader import iter_safetensors

    half.load_weights(iter_safetensors(d))
    for lf, lh in zip(full.layers, half.layers, strict=True):
        assert torch.equal(lh.mlp.experts.gate_up_proj, lf.mlp.experts.gate_up_proj[2:])
        assert torch.equal(lh.mlp.experts.down_proj, lf.mlp.experts.down_proj[2:])


def test_moe_missing_or_misshapen_expert_weight_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _, d = _hf_moe_dir(tmp_path, "mixtral-moe")
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(f))
    with pytest.raises(ValueError, match="lacks 1 weight"):
        load_model(d, ModelConfig.from_path(d), "auto", torch.float32, torch.device("cpu"))
    # a tensor of the wrong shape is named, not copied in part
    tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"] = torch.zeros(5, 64)
    save_file(tensors, str(f))
    with pytest.raises(ValueError, match=r"experts\.3\.w3\.weight: shape \(5, 64\)"):
        load_model(d, ModelConfig.from_path(d), "auto", torch.float32, torch.device("cpu"))


def test_moe_dummy_weights() -> None:
    cfg = ModelConfig.from_dict({**_SMALL, "architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "num_experts": 8, "moe_intermediate_size": 16,
                                 "num_experts_per_tok": 2})
    m = load_model(None, cfg, "dummy", torch.float32, torch.device("cpu"), seed=3)  # type: ignore[arg-type]
    w = m.layers[0].mlp.experts.gate_up_proj
    assert w.shape == (8, 32, 64) and 0.015 < w.std().item() < 0.025
