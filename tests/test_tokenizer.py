"""The worker's tokenizer: which one a model gets (presets, missing tokenizers), the character bound,
chat-template errors, and streamed text equal to a full decode."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from sglang_ext.configs import preset_config_file
from sglang_ext.entry.engine import Engine, WorkerDied
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.default_model import ensure_default_model
from sglang_ext.sampling.params import InvalidRequest
from sglang_ext.server_args import ServerArgs
from sglang_ext.worker.tokenizer import IncrementalDetokenizer, StartupError, Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(ensure_default_model())


def test_preset_gets_the_embedded_tokenizer_with_its_own_eos(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dict(json.loads(preset_config_file("llama-3.2-1b").read_text()))
    preset_dir = tmp_path / "preset"  # what resolve_model_path makes: config.json and nothing else
    preset_dir.mkdir()
    shutil.copy(preset_config_file("llama-3.2-1b"), preset_dir / "config.json")
    t = load_tokenizer(ServerArgs(model_path="preset:llama-3.2-1b", load_format="dummy"), preset_dir, cfg)
    assert t is not None and t.eos_ids == frozenset(cfg.eos_token_ids) == {128001}
    ids = t.encode("Hello there")
    assert ids and max(ids) < len(t.hf) < cfg.vocab_size
    # Ids beyond the tokenizer's vocabulary are valid model ids; they decode to nothing.
    high = [cfg.vocab_size - 1, 5000]
    assert t.decode(ids + high, skip_special_tokens=True) == t.decode(ids, skip_special_tokens=True)
    d = IncrementalDetokenizer(t, True, None, False)
    assert "".join(d.add([i], k == len(ids) + 1, None) for k, i in enumerate(ids + high)) == "Hello there"
    # An explicit --tokenizer-path still wins over the embedded one.
    own = load_tokenizer(ServerArgs(model_path="preset:llama-3.2-1b", tokenizer_path=str(ensure_default_model())),
                         preset_dir, cfg)
    assert own is not None and own.eos_ids == {own.hf.eos_token_id}
    assert load_tokenizer(ServerArgs(model_path="preset:llama-3.2-1b", skip_tokenizer_init=True),
                          preset_dir, cfg) is None


def test_directory_without_tokenizer_is_one_clear_error(tmp_path: Path) -> None:
    src = ensure_default_model()
    shutil.copy(src / "config.json", tmp_path / "config.json")
    cfg = ModelConfig.from_path(tmp_path)
    with pytest.raises(StartupError) as e:
        load_tokenizer(ServerArgs(model_path=str(tmp_path)), tmp_path, cfg)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path) in msg
    assert "--tokenizer-path" in msg and "--skip-tokenizer-init" in msg
    with pytest.raises(StartupError, match="--tokenizer-path '/nonexistent'"):
        load_tokenizer(ServerArgs(model_path=str(tmp_path), tokenizer_path="/nonexistent"), tmp_path, cfg)
    (tmp_path / "tokenizer.json").write_text("{not json")  # present but broken: the loader's reason, one line
    with pytest.raises(StartupError, match="no usable tokenizer") as e:
        load_tokenizer(ServerArgs(model_path=str(tmp_path)), tmp_path, cfg)
    assert "\n" not in str(e.value)


def test_engine_on_a_directory_without_tokenizer_fails_at_start(tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    src = ensure_default_model()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(src / f, tmp_path / f)
    with pytest.raises(WorkerDied, match="could not start"):
        Engine(model_path=str(tmp_path), device="cpu", max_total_tokens=4096)
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if "cannot start" in ln]
    assert len(lines) == 1 and "no usable tokenizer" in lines[0] and "--skip-tokenizer-init" in lines[0], err
    assert "Traceback" not in err


def test_max_token_chars_bounds_every_token(tok: Tokenizer) -> None:
    k = tok.max_token_chars
    vocab = tok.hf.get_vocab()
    assert k == max(max(len(t) for t in vocab), *(len(tok.decode([i], False)) for i in vocab.values()))
    text = (Path(__file__).resolve().parents[1] / "sglang_ext/models/default_corpus.txt").read_text()
    assert len(tok.encode(text)) >= len(text) / k


def test_chat_template_input_errors_are_invalid_requests_and_bugs_are_not(
    tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for bad in ([{"role": "user"}], [{"content": "no role"}], "not a list"):
        with pytest.raises(InvalidRequest, match="chat template"):
            tok.apply_chat_template(bad)  # type: ignore[arg-type]

    def broken(*a: Any, **k: Any) -> Any:
        raise OSError("disk gone")

    monkeypatch.setattr(tok.hf, "apply_chat_template", broken)
    with pytest.raises(OSError, match="disk gone"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("streaming", [True, False], ids=["DecodeStream", "window"])
def test_streamed_text_equals_full_decode(tok: Tokenizer, streaming: bool) -> None:
    """Random ids (special tokens, split UTF-8 sequences) in random chunks: the concatenated deltas
    are exactly the full decode, with the `tokenizers` stream and with the fallback."""
    assert tok.streams  # the embedded tokenizer is fast, with no clean-up: the stream applies
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(len(tok.hf)) for _ in range(rng.randint(1, 48))]
        skip = rng.random() < 0.5
        d = IncrementalDetokenizer(tok, skip, None, False)
        if not streaming:
            d.stream = None
        out, i = "", 0
        while i < len(ids):
            n = rng.randint(1, 3)
            out += d.add(ids[i : i + n], i + n >= len(ids), None)
            i += n
        assert out == tok.decode(ids, skip), ids


def test_stop_string_hold_back_with_the_stream(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta gamma")[1:]  # without BOS; the scheduler stops at "gamma"
    d = IncrementalDetokenizer(tok, True, ["gamma"], False)
    assert d.stream is not None
    sent = "".join(d.add([t], False, None) for t in ids[:-1])
    assert "g" not in sent  # a tail that may start the stop string is held back
    assert sent + d.add(ids[-1:], True, "gamma") == "alpha beta "


def test_generic_fast_tokenizer_skips_auto_but_matches_it(tmp_path: Path) -> None:
    """A tokenizer_config naming PreTrainedTokenizerFast loads that class directly (AutoTokenizer's import
    costs seconds of a worker's start); what comes out is what AutoTokenizer gives. Any other class, or a
    directory without tokenizer.json, still goes through AutoTokenizer."""
    from transformers import AutoTokenizer

    from sglang_ext.worker import tokenizer as tk

    src = ensure_default_model()
    assert tk._plain_fast_tokenizer(src)
    fast, auto = Tokenizer.from_dir(src), AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    assert type(fast.hf) is type(auto)
    text = "Hello <|im_start|>user\nwörld 123  tabs\t!"
    assert fast.encode(text) == list(auto.encode(text))
    assert fast.hf.get_vocab() == auto.get_vocab() and fast.hf.all_special_ids == auto.all_special_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert fast.apply_chat_template(msgs) == list(auto.apply_chat_template(msgs, add_generation_prompt=True,
                                                                          tokenize=True, return_dict=False))
    other = tmp_path / "other"
    shutil.copytree(src, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "LlamaTokenizerFast"}))
    assert not tk._plain_fast_tokenizer(other)
    (other / "tokenizer_config.json").write_text("{not json")
    assert not tk._plain_fast_tokenizer(other)
    noj = tmp_path / "nojson"
    noj.mkdir()
    shutil.copy(src / "tokenizer_config.json", noj / "tokenizer_config.json")
    assert not tk._plain_fast_tokenizer(noj)
