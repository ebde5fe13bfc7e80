"""Tokenizer side of a worker: encode prompts, apply chat templates, stream text out."""

from __future__ import annotations

import json
import logging
from functools import cached_property
from pathlib import Path
from typing import Any

from sglang_ext.models.config import ModelConfig
from sglang_ext.models.resolve import PRESET_PREFIX
from sglang_ext.sampling.params import InvalidRequest
from sglang_ext.server_args import ServerArgs

logger = logging.getLogger(__name__)


# Any of these makes a directory worth handing to AutoTokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                    "tiktoken.model")


# tokenizer_config.json classes that name the generic `tokenizers`-backed class itself (transformers 4.x
# and 5.x spellings), for which AutoTokenizer resolves to PreTrainedTokenizerFast with nothing model-specific.
_PLAIN_FAST_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def _plain_fast_tokenizer(path: Path) -> bool:
    """Whether the directory holds a tokenizer.json whose config names the generic fast class."""
    cfg = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # AutoTokenizer reports what is wrong with it
    return isinstance(data, dict) and data.get("tokenizer_class") in _PLAIN_FAST_CLASSES


class StartupError(RuntimeError):
    """A configuration problem found while a worker starts: reported as one line, no traceback."""


class Tokenizer:
    def __init__(self, hf: Any, eos_ids: frozenset[int] | None = None) -> None:
        self.hf = hf
        self.eos_ids = eos_ids if eos_ids is not None else frozenset({hf.eos_token_id} - {None})
        self.has_chat_template = bool(getattr(hf, "chat_template", None))
        # The `tokenizers` streaming decoder reproduces `hf.decode` only where transformers adds no
        # post-processing of its own (clean_up_tokenization_spaces off).
        self.backend = hf.backend_tokenizer if getattr(hf, "is_fast", False) else None
        self.streams = self.backend is not None and not getattr(hf, "clean_up_tokenization_spaces", False)

    @classmethod
    def from_dir(cls, path: str | Path, eos_ids: frozenset[int] | None = None) -> Tokenizer:
        # local_files_only: a directory without tokenizer files must fail here, not try the Hub.
        if _plain_fast_tokenizer(Path(path)):
            # The class AutoTokenizer would pick anyway, without importing transformers' auto
            # factories (generation, torch.distributed.tensor, and sklearn/sympy where installed):
            # 5-10 s of a worker's start on the GPU machine, 1 s here (bench/probe_startup.py).
            from transformers import PreTrainedTokenizerFast

            return cls(PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True), eos_ids)
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True), eos_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # transformers' fast path calls the Rust batch encoder, which releases the GIL: the worker's
        # event loop and forward thread run on while a long prompt is tokenized on another thread.
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """`tools`: OpenAI tool objects, which the template renders (as transformers passes them)."""
        from jinja2 import TemplateError

        if not self.has_chat_template:
            raise InvalidRequest("this model's tokenizer has no chat template; use /v1/completions")
        try:
            # return_dict=False: a plain id list on transformers 4.x and 5.x alike.
            ids = self.hf.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=False,
            )
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            # The template rejected these messages (raise_exception, a missing key, a wrong type):
            # the caller's input. Anything else is a server bug and propagates as one (500, logged).
            raise InvalidRequest(f"messages could not be formatted with the chat template: {e}") from None
        if hasattr(ids, "keys"):  # a BatchEncoding despite return_dict=False
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id])

    @cached_property
    def max_token_chars(self) -> int:
        """Most characters of text one token can stand for: a prompt of more than
        context_length * this many characters cannot fit, whatever it is (tokens >= chars / this).

        Per token the larger of its decoded text and its vocabulary string: decoding one token alone
        drops a SentencePiece word's leading space ("▁the" -> "the"), and a byte-level string
        ("Ġthe") has one character per byte, so the larger one never undercounts."""
        vocab: dict[str, int] = self.hf.get_vocab()
        longest = max((len(t) for t in vocab), default=1)
        if self.backend is not None:  # Rust batch decode of every id: well under a second for 150K ids
            texts = self.backend.decode_batch([[i] for i in sorted(set(vocab.values()))], skip_special_tokens=False)
            longest = max(longest, *(len(t) for t in texts))
        return max(longest, 1)

    def decode_stream(self, skip_special_tokens: bool) -> Any:
        """A `tokenizers` DecodeStream where it reproduces `decode`, else None."""
        if not self.streams:
            return None
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=skip_special_tokens)


def load_tokenizer(args: ServerArgs, model_dir: Path, cfg: ModelConfig) -> Tokenizer | None:
    """The worker's tokenizer: none (--skip-tokenizer-init), --tokenizer-path, the embedded byte-level
    BPE for presets (config-only directories), else the model directory's own."""
    if args.skip_tokenizer_init:
        return None
    if args.tokenizer_path is None and (args.model_path or "").startswith(PRESET_PREFIX):
        from sglang_ext.models.default_model import ensure_default_model

        # A preset has no tokenizer files and nothing may be downloaded. The embedded model's
        # tokenizer covers the low ids of the preset's vocabulary; higher ids are valid model ids
        # that decode to ''. EOS is the preset's, so generation stops where the real model would.
        tok = Tokenizer.from_dir(ensure_default_model(), eos_ids=frozenset(cfg.eos_token_ids))
        logger.info(
            "%s has no tokenizer: using the embedded byte-level BPE tokenizer (%d of the model's %d ids "
            "decode to text), eos %s from the preset", args.model_path, len(tok.hf), cfg.vocab_size,
            sorted(cfg.eos_token_ids),
        )
        return tok
    where = Path(args.tokenizer_path).expanduser() if args.tokenizer_path else model_dir
    flag = "--tokenizer-path" if args.tokenizer_path else "model directory"
    why = None
    if not where.is_dir():
        why = "no such directory"
    elif not any((where / f).is_file() for f in _TOKENIZER_FILES):
        why = "no tokenizer files in it"
    else:
        try:
            return Tokenizer.from_dir(where)
        except Exception as e:  # whatever failed, the user's fix is the same: say which directory
            why = " ".join(str(e).split()) or type(e).__name__  # one line
            if len(why) > 300:
                why = why[:300] + "..."
    raise StartupError(
        f"no usable tokenizer in {flag} {str(where)!r} ({why}); pass --tokenizer-path DIR, "
        "or --skip-tokenizer-init to serve token ids only"
    )


class IncrementalDetokenizer:
    """Emits text as tokens arrive without re-decoding everything (offsets as in vLLM/SGLang): decode
    a short window (the previous emission's tokens + the new ones) and hold back output ending in an
    incomplete UTF-8 character. Fast tokenizers run that loop in Rust (`tokenizers`' DecodeStream, one
    decode per step); others, or a stream that fails, use the same algorithm here."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool, stop: list[str] | None, keep_stop: bool) -> None:
        self.tok = tok
        self.skip = skip_special_tokens
        self.stream = tok.decode_stream(skip_special_tokens)
        self.ids: list[int] = []
        self.surr = 0  # window start: first token of the previous emission
        self.read = 0  # tokens already turned into emitted text
        self.text = ""  # all text decided so far
        self.sent = 0  # chars of self.text already emitted
        self.stop = stop or []
        self.keep_stop = keep_stop

    def add(self, new_ids: list[int], finished: bool, matched_stop: str | None) -> str:
        self.ids.extend(new_ids)
        if self.stream is not None and new_ids:
            try:
                chunk = self.stream.step(self.tok.backend, new_ids)
            except Exception:  # e.g. a decoder whose output is not prefix-stable: use the window method
                logger.debug("DecodeStream failed; decoding windows instead", exc_info=True)
                self.stream = None
            else:
                if chunk is not None:
                    self.text += chunk
                    self.surr, self.read = self.read, len(self.ids)
        if self.stream is None or (finished and self.read < len(self.ids)):
            self._window(finished)  # also flushes a tail the stream holds back (an incomplete char)
        limit = len(self.text)
        if matched_stop is not None:
            at = self.text.find(matched_stop)
            if at >= 0:
                limit = at + (len(matched_stop) if self.keep_stop else 0)
        elif self.stop and not finished:
            # Hold back a tail that could be the start of a stop string.
            hold = max(len(s) for s in self.stop) - 1
            limit = max(len(self.text) - hold, self.sent)
        out = self.text[self.sent : max(limit, self.sent)]
        self.sent = max(limit, self.sent)
        return out

    def _window(self, finished: bool) -> None:
        prefix = self.tok.decode(self.ids[self.surr : self.read], self.skip)
        full = self.tok.decode(self.ids[self.surr :], self.skip)
        if len(full) > len(prefix) and (finished or not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self.surr, self.read = self.read, len(self.ids)
