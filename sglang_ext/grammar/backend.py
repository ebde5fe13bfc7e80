"""Compiling constraints into grammars (xgrammar), cached by (kind, text).

xgrammar is imported on first use: a worker that never gets a constrained request never loads it.
Compiling needs every token's bytes (`TokenizerInfo`, built once from the HF tokenizer, sized to the
model's logits width so padding ids beyond the tokenizer are never allowed); grammars are then
compiled once per distinct constraint and kept in an LRU cache. The worker server calls `compile`
on its grammar thread before a request reaches the forward thread (worker/server.py), so a slow
compile delays only its own request, and a bad constraint is a 400 before anything is queued.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from sglang_ext.sampling.params import InvalidRequest, SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr

KINDS: Final = ("regex", "json_schema", "ebnf", "structural_tag")  # SamplingParams fields, in SGLang's names
CACHE_SIZE: Final = 512
# xgrammar's C++ errors start with "[12:00:00] /project/cpp/file.cc:94: " and may carry a failed check.
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class Constraint(NamedTuple):
    kind: str  # one of KINDS
    text: str


def constraint_of(p: SamplingParams) -> Constraint | None:
    """The request's constraint (SamplingParams.validate allows at most one)."""
    for kind in KINDS:
        text = getattr(p, kind)
        if text is not None:
            return Constraint(kind, text)
    return None


class GrammarState:
    """One request's matcher. It advances by each token the request keeps and is never re-fed: a
    request that is preempted (recompute or rotation) keeps its output tokens and this state."""

    __slots__ = ("error", "matcher")

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher
        self.error: str | None = None  # set if a token was refused (a bug: the mask allows only valid ones)

    def accept(self, token: int) -> None:
        if self.error is None and not self.matcher.accept_token(token):
            self.error = f"the grammar refused token {token}"

    @property
    def live(self) -> bool:
        """It can take another token: not ended, no token refused."""
        return self.error is None and not self.terminated

    @property
    def terminated(self) -> bool:
        """The grammar ended (it accepted a stop token): nothing may follow."""
        return bool(self.matcher.is_terminated())


class GrammarBackend:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int], *,
                 any_whitespace: bool = True, cache_size: int = CACHE_SIZE) -> None:
        """`tokenizer`: a HF tokenizer. `any_whitespace`: JSON schemas admit free whitespace between
        tokens (SGLang's default); off, JSON is compact (", ", ": ")."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(set(stop_ids))
        self.any_whitespace = any_whitespace
        self._cache: OrderedDict[Constraint, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None

    def compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                # Its own cache stays off: ours, keyed by the request's text, is the one to consult.
                self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=2, cache_enabled=False)
            return self._compiler

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        """Every token's bytes, as xgrammar compiles against them: read from the HF tokenizer."""
        import xgrammar as xgr

        return xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_ids)

    def compile(self, c: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar of `c` (cached); InvalidRequest naming the problem if it is not valid."""
        with self._lock:
            hit = self._cache.get(c)
            if hit is not None:
                self._cache.move_to_end(c)
                return hit
        compiled = self._compile(self.compiler(), c, self.any_whitespace)
        with self._lock:
            self._cache[c] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, c: Constraint) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compile(c)))

    @staticmethod
    def _compile(compiler: xgr.GrammarCompiler, c: Constraint, any_whitespace: bool) -> xgr.CompiledGrammar:
        try:
            if c.kind == "regex":
                return compiler.compile_regex(c.text)
            if c.kind == "json_schema":
                return compiler.compile_json_schema(c.text, any_whitespace=any_whitespace)
            if c.kind == "ebnf":
                return compiler.compile_grammar(c.text)
            return _compile_structural_tag(compiler, c.text)
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            raise InvalidRequest(f"sampling_params.{c.kind} is not valid: {_clean(str(e))}") from None


def _compile_structural_tag(compiler: xgr.GrammarCompiler, text: str) -> xgr.CompiledGrammar:
    """SGLang's two forms: {"structures": [{"begin", "schema", "end"}], "triggers": [...]} (the older
    one, still what its OpenAI server builds) or xgrammar's {"type": "structural_tag", "format": ...}."""
    tag = json.loads(text)
    if isinstance(tag, dict) and "structures" in tag:
        import xgrammar as xgr

        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return compiler.compile_structural_tag(items, tag["triggers"])
    return compiler.compile_structural_tag(text)


def _clean(message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else message
    return _LOCATION.sub("", first).strip()
