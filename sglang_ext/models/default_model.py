"""The embedded default model: a tiny Llama built offline on first use, byte-for-byte reproducible.

Nothing is downloaded. The tokenizer (byte-level BPE) is trained on `default_corpus.txt`, which
ships with the package; the weights come from a seeded generator. The result is an ordinary HF
model directory, so HF `transformers` can load it too (tests compare against that).

    $SGLANG_EXT_CACHE (or ~/.cache/sglang_ext)/
        default-llama-v2/           <- renamed into place only once complete
            config.json  generation_config.json  model.safetensors
            tokenizer.json  tokenizer_config.json  special_tokens_map.json
        .default-llama-v2.XXXX/     <- a build in progress (one per building process)

Change anything that alters the output, and bump `DEFAULT_MODEL_NAME`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Final

import torch

from sglang_ext.configs import cache_root

DEFAULT_MODEL_NAME: Final = "default-llama-v2"
CORPUS_FILE: Final = Path(__file__).resolve().parent / "default_corpus.txt"
SEED: Final = 20240601

BOS: Final = "<|begin_of_text|>"
EOS: Final = "<|end_of_text|>"
PAD: Final = "<|pad|>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
SPECIAL_TOKENS: Final = (BOS, EOS, PAD, IM_START, IM_END)  # ids 0..4, in this order
VOCAB_SIZE: Final = 2048  # special tokens included

# ChatML turns after a leading BOS (as Llama 3 does: apply_chat_template adds no specials itself).
# With OpenAI tools, a system turn lists them and asks for Qwen 2.5's call format, so the default tool-call
# parser (qwen25) reads what a model trained on this template would write; an assistant turn's calls and
# tool results render that way too. Messages without tools render as plain ChatML.
_TOOLS_INTRO: Final = (
    "# Tools\n\nYou may call one or more of the functions below; their JSON signatures are inside "
    "<tools></tools>:\n<tools>"
)
_TOOLS_HOWTO: Final = (
    "\n</tools>\n\nTo call a function, write a JSON object with its name and arguments inside "
    "<tool_call></tool_call> tags, one call per pair:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- " + repr(_TOOLS_INTRO) + " }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- " + repr(_TOOLS_HOWTO) + " + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set f = call['function'] if call['function'] is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\n' }}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + (message['content'] or '') + '\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Geometry. head_dim 64 (not 32) because FlashInfer's prebuilt kernels cover 64/128/256 only.
HIDDEN: Final = 512
LAYERS: Final = 4
HEADS: Final = 8
KV_HEADS: Final = 4
HEAD_DIM: Final = HIDDEN // HEADS
INTERMEDIATE: Final = 1024
MAX_POSITIONS: Final = 4096
# Larger than the usual 0.02 so attention is sharp; the head larger still, so logits spread by
# ~4.5 and greedy argmax rarely hinges on a near-tie (bf16 runs would otherwise diverge from fp32).
WEIGHT_STD: Final = 0.08
LM_HEAD_STD: Final = 0.2


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the default model directory, building it first if absent (safe across processes)."""
    root = cache_dir if cache_dir is not None else cache_root()
    target = root / DEFAULT_MODEL_NAME
    if target.is_dir():
        return target  # only ever created by the rename below, so it is complete
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=root))
    try:
        build_default_model(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            # Another process finished first; its copy is identical, keep it.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_default_model(out: Path) -> None:
    """Write every file of the default model into the existing directory `out`."""
    tok = train_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(ids))
    _write_json(out / "special_tokens_map.json", _special_tokens_map())
    config = _model_config(tok.get_vocab_size(), ids)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[IM_END]],
        "pad_token_id": ids[PAD],
    })
    from safetensors.torch import save_file

    save_file(make_weights(config), str(out / "model.safetensors"), metadata={"format": "pt"})


def train_tokenizer() -> Any:
    """Byte-level BPE over the shipped corpus; the trainer is deterministic for a fixed input."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS_FILE.read_text(encoding="utf-8").splitlines(), trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, bos)],
    )
    return tok


def _tokenizer_config(ids: dict[str, int]) -> dict[str, Any]:
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for t, i in sorted(ids.items(), key=lambda kv: kv[1])
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,  # keeps decode(encode(s)) == s
        "eos_token": EOS,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MAX_POSITIONS,
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _special_tokens_map() -> dict[str, Any]:
    return {"additional_special_tokens": [IM_START, IM_END], "bos_token": BOS, "eos_token": EOS,
            "pad_token": PAD}


def _model_config(vocab: int, ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[IM_END]],  # stop at a chat turn's end as well
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": WEIGHT_STD,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "pad_token_id": ids[PAD],
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab,
    }


def make_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF-named tensors, drawn in a fixed order from one seeded generator, stored as bfloat16."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        # Norm gains near one (not exactly, so a loader that skips them is caught).
        if len(shape) == 1:
            x = 1.0 + 0.1 * x
        else:
            x = x * (LM_HEAD_STD if name == "lm_head.weight" else WEIGHT_STD)
        out[name] = x.to(torch.bfloat16).contiguous()
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
