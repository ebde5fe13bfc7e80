"""Compiling constraints into grammars (xgrammar), cached by (kind, text).

xgrammar is imported on first use: a worker that never gets a constrained request never loads it.
Compiling needs every token's bytes (`TokenizerInfo`, built once from the HF tokenizer, sized to the
model's logits width so padding ids beyond the tokenizer are never allowed); grammars are then
compiled once per distinct constraint on a bounded pool of threads with a size limit, a time limit
and an LRU cache (pool.py). The worker server submits a request's constraint there before the
request reaches the forward thread (worker/server.py), so a slow compile delays only its own
request, a small constraint never waits behind large ones, and a bad constraint is a 400 before
anything is queued.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from sglang_ext.grammar.pool import CompilePool
from sglang_ext.sampling.params import InvalidRequest, SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr

KINDS: Final = ("regex", "json_schema", "ebnf", "structural_tag")  # SamplingParams fields, in SGLang's names
CACHE_SIZE: Final = 512
COMPILER_THREADS: Final = 2  # xgrammar's own threads per compile (it splits the token masks among them)
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
                 any_whitespace: bool = True, workers: int = 2, max_bytes: int = 65536,
                 timeout_s: float = 60.0, cache_size: int = CACHE_SIZE, queue_size: int = 64) -> None:
        """`tokenizer`: a HF tokenizer. `any_whitespace`: JSON schemas admit free whitespace between
        tokens (SGLang's default); off, JSON is compact (", ", ": "). The rest size the compile
        pool (pool.py; the server arguments `grammar_*`)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(set(stop_ids))
        self.any_whitespace = any_whitespace
        self._lock = threading.Lock()
        self._info: xgr.TokenizerInfo | None = None
        self._local = threading.local()  # each compile thread's compiler
        self.pool: CompilePool[xgr.CompiledGrammar] = CompilePool(
            self._compile_here, workers=workers, max_bytes=max_bytes, timeout_s=timeout_s,
            cache_size=cache_size, queue_size=queue_size)

    def submit(self, c: Constraint) -> Future[xgr.CompiledGrammar]:
        """`c`'s compiled grammar, as a future (done at once when cached); see CompilePool.submit."""
        return self.pool.submit(c)

    def compiler(self) -> xgr.GrammarCompiler:
        """This thread's compiler: one per compile thread, so that concurrent compiles share nothing
        of xgrammar's but the read-only TokenizerInfo."""
        compiler: xgr.GrammarCompiler | None = getattr(self._local, "compiler", None)
        if compiler is None:
            import xgrammar as xgr

            # Its own cache stays off: ours, keyed by the request's text, is the one to consult.
            compiler = xgr.GrammarCompiler(self.tokenizer_info(), max_threads=COMPILER_THREADS,
                                           cache_enabled=False)
            self._local.compiler = compiler
        return compiler

    def tokenizer_info(self) -> xgr.TokenizerInfo:
        with self._lock:
            if self._info is None:
                self._info = self._tokenizer_info()
            return self._info

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        """Every token's bytes, as xgrammar compiles against them: read from the HF tokenizer."""
        import xgrammar as xgr

        return xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_ids)

    def compile(self, c: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar of `c` (cached), waiting for it; InvalidRequest naming the problem if
        it is not valid (or too long, or over the time limit), GrammarBusy if the pool is full."""
        return self.submit(c).result()

    @staticmethod
    def state(compiled: xgr.CompiledGrammar) -> GrammarState:
        """A fresh matcher of a compiled grammar (cheap: the compiled grammar is shared)."""
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled))

    def _compile_here(self, c: Constraint) -> xgr.CompiledGrammar:
        return self._compile(self.compiler(), c, self.any_whitespace)

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
