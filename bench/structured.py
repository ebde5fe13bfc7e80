"""Decode step time with structured output: batch sizes 64 and 256 with 0 %, 50 % and 100 % of the
rows constrained by a JSON schema, against the unconstrained step (Llama-3-8B geometry, dummy weights).

    python bench/structured.py --out structured.json      # on a GPU (needs xgrammar, a dependency)
    python bench/structured.py --smoke                    # CPU: the same logic at toy sizes (CI-sized)

Each point measures two loops over the same batch. Drained: what the scheduler's plain loop runs
(`Scheduler._process`; also the overlap loop with `--disable-grammar-overlap`): forward (CUDA graph),
the constrained rows' bitmask filled on the host (xgrammar's batched fill, threads), copied and applied
to the logits on the device, sampled, tokens to the host, matchers advanced. Overlapped: what the
overlap loop runs (`Scheduler(overlap=True)`, scheduler/overlap.py): step t+1's forward is queued with step
t's sampled tokens (on the device) as input ids, then the host waits for t's tokens, the matchers take
them, t+1's masks are filled while its forward runs, copied, applied, and t+1 is sampled. Each
constrained row's matcher walks the schema; one that reaches its end starts over, so every step
exercises real grammar states. Per point:

  step_ms          drained: wall time per step, each step synchronizing (the matchers need its tokens)
  overhead         step_ms / the same batch's unconstrained step_ms - 1
  overlap_step_ms  overlapped: wall time per step
  overlap_overhead overlap_step_ms / the same batch's unconstrained overlap_step_ms - 1 (the issue's
                   target: <= 10 % at 100 %; the unconstrained step runs overlapped in the server)
  mask_late        overlapped, GPU: share of steps whose forward had finished before the masks were
                   filled (the GPU waited for the host); 0 means the mask for t+1 was always ready first
  fill_ms, overlap_fill_ms   host time of the batched bitmask fill (median over steps), per loop
  accept_ms        host time of advancing the matchers (drained loop)
  mask_gpu_ms      device time of the bitmask copy + apply (events around them; drained loop)
  async_step_ms    the unconstrained step issued back to back without a sync: the bound the overlap
                   loop approaches

The embedded tokenizer knows 2048 ids; a grammar over it would mask the other 126K trivially. So the
grammar gets a 128K-token vocabulary of its own: `--vocab-file` reads a real BPE vocabulary (Mistral's
Tekken, 131K tokens, from a mistral_common wheel: `pip download --no-deps mistral_common`), the one to
quote; without it, a synthetic one (words and pieces of the embedded corpus with JSON punctuation glued
to both ends, deterministic). The synthetic one is a worst case, not a real vocabulary's work: so many
tokens mix punctuation and text that xgrammar can decide few of them ahead, and its fill costs
~0.35-0.6 ms per row on one core against ~0.01-0.02 ms with Tekken (measured on the CPU machine).
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import statistics
import sys
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.forward_batch import BatchRow, ForwardBatch, ForwardMode
from sglang_ext.grammar.backend import Constraint, GrammarBackend, GrammarState
from sglang_ext.grammar.masks import GrammarMasks
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.default_model import CORPUS_FILE
from sglang_ext.models.resolve import resolve_model_path
from sglang_ext.sampling.batch import SampleRow
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.sampling.sampler import Sampler
from sglang_ext.server_args import ServerArgs

if TYPE_CHECKING:
    import xgrammar as xgr

PAGE = 16
SCHEMA: dict[str, Any] = {  # a typical extraction schema: nested object, enum, array, numbers, strings
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.(com|org|net)$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["street", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
}


def synthetic_vocab(size: int, seed: int = 0) -> list[str]:
    """`size` distinct token texts shaped like a BPE vocabulary (see the module docstring)."""
    rng = random.Random(seed)
    words = sorted(set(CORPUS_FILE.read_text().split()))
    pieces = [chr(c) for c in range(32, 127)] + [" ", "\n", "  ", "\t"]
    affix = ["", " ", '"', ' "', '":', '",', ", ", ": ", "{", '{"', "}", "},", "[", "]", "\n", "."]
    out = list(dict.fromkeys(pieces))
    seen = set(out)
    while len(out) < size:
        w = rng.choice(words)
        if rng.random() < 0.4:
            i = rng.randrange(len(w))
            w = w[i : i + rng.randint(1, 6)]
        if rng.random() < 0.1:
            w = str(rng.randrange(10 ** rng.randint(1, 4)))
        t = rng.choice(affix) + w + (rng.choice(affix) if rng.random() < 0.2 else "")
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def tekken_vocab(path: str, size: int) -> list[bytes]:
    """The first `size` token byte strings of Mistral's Tekken BPE vocabulary (131K tokens, tiktoken-style
    like Llama 3's), read from `tekken_240911.json` or straight from a mistral_common wheel that has it.
    Tekken's first 1000 ids are its special tokens; they stay out (text ids come first here, as in Llama 3)."""
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            raw = z.read("mistral_common/data/tekken_240911.json")
    else:
        raw = Path(path).read_bytes()
    vocab = [base64.b64decode(t["token_bytes"]) for t in json.loads(raw)["vocab"][:size]]
    if len(vocab) < size:
        raise SystemExit(f"{path}: {len(vocab)} tokens, {size} needed")
    return vocab


class RawVocabGrammars(GrammarBackend):
    """Grammars over a vocabulary given as each token's text (xgrammar's raw vocabulary type): the
    benchmark's 128K-token vocabulary has no HF tokenizer behind it."""

    def __init__(self, words: list[str] | list[bytes], vocab_size: int, stop_ids: list[int]) -> None:
        super().__init__(None, vocab_size, stop_ids)
        self._words = words

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        import xgrammar as xgr

        return xgr.TokenizerInfo(self._words, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                 stop_token_ids=self.stop_ids)


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        cuda = not a.smoke
        self.device = torch.device("cuda" if cuda else "cpu")
        model_dir = resolve_model_path(None if a.smoke else a.model_path)
        self.cfg = ModelConfig.from_path(model_dir)
        self.bs_list = [int(x) for x in (a.batch_sizes or ("4,8" if a.smoke else "64,256")).split(",")]
        tokens = max(self.bs_list) * (a.ctx + PAGE) + 64 * PAGE
        self.args = ServerArgs(model_path=None if a.smoke else a.model_path, load_format="dummy",
                               device=str(self.device), dtype="float32" if a.smoke else "bfloat16",
                               page_size=PAGE, max_total_tokens=tokens, cuda_graph_max_bs=max(self.bs_list),
                               skip_tokenizer_init=True)
        self.runner = ModelRunner(self.args, model_dir, self.cfg)
        vocab = self.cfg.vocab_size
        eos = sorted(self.cfg.eos_token_ids)
        text_ids = vocab - max(256, len(eos))  # the top ids stay special, as in Llama 3
        t0 = time.perf_counter()
        words = tekken_vocab(a.vocab_file, text_ids) if a.vocab_file else synthetic_vocab(text_ids)
        self.grammars = RawVocabGrammars(words, vocab, eos)
        self.compiled = self.grammars.compile(Constraint("json_schema", json.dumps(SCHEMA)))
        self.compile_s = time.perf_counter() - t0
        self.masks = GrammarMasks(vocab, self.device, threads=a.fill_threads)
        self.sampler = Sampler(vocab, self.device)

    def decode_batch(self, bs: int) -> ForwardBatch:
        n = -(-self.a.ctx // PAGE)
        rows = [BatchRow(self.a.ctx - 1, [100 + i], list(range(1 + i * n, 1 + (i + 1) * n)), [0]) for i in range(bs)]
        return ForwardBatch.build(rows, ForwardMode.DECODE, PAGE, self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def point(self, bs: int, share: float) -> dict[str, Any]:
        import xgrammar as xgr

        batch = self.decode_batch(bs)
        n_con = round(bs * share)
        states: list[GrammarState | None] = [
            GrammarState(xgr.GrammarMatcher(self.compiled)) if i < n_con else None for i in range(bs)]
        params = SamplingParams(temperature=0.0)
        fill: list[float] = []
        accept: list[float] = []
        gpu: list[Any] = []
        self._time_fill(fill)
        every = list(range(bs))

        def step(k: int) -> None:
            logits = self.runner.forward(batch)[every]  # as Scheduler._process: the sampled rows, a copy
            rows = [SampleRow(params, k)] * bs
            if n_con:
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.device.type == "cuda" else []
                if ev:
                    ev[0].record()
                rows = self.masks.constrain(logits, states, rows)
                if ev:
                    ev[1].record()
                    gpu.append(ev)
            tokens = self.sampler.sample(logits, self.sampler.batch(rows)).tolist()
            t0 = time.perf_counter()
            for s, t in zip(states, tokens, strict=True):
                if s is not None:
                    s.accept(t)
                    if s.terminated or s.error:
                        s.matcher.reset()
                        s.error = None
            accept.append(time.perf_counter() - t0)

        try:
            for k in range(3):
                step(k)
            fill.clear(), accept.clear(), gpu.clear()
            self.sync()
            t0 = time.perf_counter()
            for k in range(self.a.steps):
                step(k)
            self.sync()
            step_s = (time.perf_counter() - t0) / self.a.steps
        finally:
            del self.masks.fill
        out: dict[str, Any] = {"bs": bs, "constrained_share": share, "constrained_rows": n_con,
                               "step_ms": step_s * 1e3, "accept_ms": statistics.median(accept) * 1e3}
        if fill:
            out["fill_ms"] = statistics.median(fill) * 1e3
        if gpu:
            out["mask_gpu_ms"] = statistics.median([e0.elapsed_time(e1) for e0, e1 in gpu])
        out.update(self.overlapped(batch, states))
        if share == 0.0:
            out["async_step_ms"] = self.async_step_ms(batch, bs)
        return out

    def overlapped(self, batch: ForwardBatch, states: list[GrammarState | None]) -> dict[str, Any]:
        """The overlap loop's steps (see the module docstring): per point, overlap_step_ms,
        overlap_fill_ms and, on a GPU, mask_late."""
        cuda = self.device.type == "cuda"
        params = SamplingParams(temperature=0.0)
        every = list(range(len(states)))
        fill: list[float] = []
        late: list[bool] = []

        def sample(logits: torch.Tensor, k: int, timed: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
            rows = [SampleRow(params, k)] * len(states)
            live = [s if s is not None and s.live else None for s in states]
            with torch.inference_mode():  # as the scheduler: the runner's logits are masked in place
                rows = self.masks.constrain(logits, live, rows)
            tokens = self.sampler.sample(logits, self.sampler.batch(rows))
            if not cuda:
                return tokens, tokens, None
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return tokens, host, done

        def run(n: int, timed: bool) -> None:
            prev = sample(self.runner.forward(batch)[every], 0, False)  # the first step: nothing in flight
            for k in range(1, n + 1):
                batch.input_ids = prev[0]  # step t+1 decodes step t's tokens, still on the device
                logits = self.runner.forward(batch)
                fwd = None
                if cuda:
                    fwd = torch.cuda.Event()
                    fwd.record()
                if prev[2] is not None:
                    prev[2].synchronize()
                for s, t in zip(states, prev[1].tolist(), strict=True):
                    if s is not None:
                        s.accept(t)
                        if s.terminated or s.error:
                            s.matcher.reset()
                            s.error = None
                if fwd is not None and timed and any(s is not None for s in states):
                    late.append(bool(fwd.query()))  # the forward done before the fill even starts
                prev = sample(logits, k, timed)
            if prev[2] is not None:
                prev[2].synchronize()

        ids = batch.input_ids
        self._time_fill(fill)
        try:
            run(3, False)
            fill.clear()
            self.sync()
            t0 = time.perf_counter()
            run(self.a.steps, True)
            self.sync()
            step_s = (time.perf_counter() - t0) / (self.a.steps + 1)
        finally:
            batch.input_ids = ids
            del self.masks.fill
        out: dict[str, Any] = {"overlap_step_ms": step_s * 1e3}
        if fill:
            out["overlap_fill_ms"] = statistics.median(fill) * 1e3
        if late:
            out["mask_late"] = sum(late) / len(late)
        return out

    def _time_fill(self, into: list[float]) -> None:
        """Time each batched bitmask fill into `into` (until `del self.masks.fill`)."""
        real = type(self.masks).fill.__get__(self.masks)

        def timed(sts: Any) -> torch.Tensor:
            t0 = time.perf_counter()
            out = real(sts)
            into.append(time.perf_counter() - t0)
            return out

        self.masks.fill = timed  # type: ignore[method-assign]

    def async_step_ms(self, batch: ForwardBatch, bs: int) -> float:
        """Unconstrained forward + greedy sampling issued back to back, one sync at the end."""
        sb = self.sampler.batch([SampleRow(SamplingParams(temperature=0.0), 0)] * bs)
        self.sync()
        t0 = time.perf_counter()
        for _ in range(self.a.steps):
            self.sampler.sample(self.runner.forward(batch), sb)
        self.sync()
        return (time.perf_counter() - t0) / self.a.steps * 1e3

    def run(self) -> dict[str, Any]:
        res: dict[str, Any] = {"env": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": str(self.device),
            "gpu": torch.cuda.get_device_name(0) if self.device.type == "cuda" else None,
            "model": "embedded default (smoke)" if self.a.smoke else self.a.model_path, "vocab": self.cfg.vocab_size,
            "ctx": self.a.ctx, "steps": self.a.steps, "fill_threads": self.masks.threads,
            "grammar_vocab": f"tekken ({self.a.vocab_file})" if self.a.vocab_file else "synthetic",
            "schema_compile_s": self.compile_s, "torch": torch.__version__, "xgrammar": _version("xgrammar")},
            "points": []}
        for bs in self.bs_list:
            base = obase = None
            for share in (0.0, 0.5, 1.0):
                p = self.point(bs, share)
                base = p["step_ms"] if base is None else base
                obase = p["overlap_step_ms"] if obase is None else obase
                p["overhead"] = p["step_ms"] / base - 1.0
                p["overlap_overhead"] = p["overlap_step_ms"] / obase - 1.0
                res["points"].append(p)
                print(f"bs={bs:4d} constrained={share:4.0%}  drained {p['step_ms']:7.2f} ms ({p['overhead']:+6.1%})"
                      f"  overlapped {p['overlap_step_ms']:7.2f} ms ({p['overlap_overhead']:+6.1%})"
                      f"  fill {p.get('fill_ms', 0):6.2f}/{p.get('overlap_fill_ms', 0):6.2f} ms"
                      f"  accept {p['accept_ms']:5.2f} ms"
                      + (f"  mask late {p['mask_late']:.0%}" if "mask_late" in p else "")
                      + (f"  mask(gpu) {p['mask_gpu_ms']:.3f} ms" if "mask_gpu_ms" in p else "")
                      + (f"  async(unconstrained) {p['async_step_ms']:.2f} ms" if "async_step_ms" in p else ""),
                      flush=True)
                Path(self.a.out).write_text(json.dumps(res, indent=1))
        return res


def _version(mod: str) -> str | None:
    try:
        return str(__import__(mod).__version__)
    except Exception:
        return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="preset:llama-3-8b")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 64,256; smoke 4,8)")
    p.add_argument("--ctx", type=int, default=1024, help="tokens of context per row")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fill-threads", type=int, default=None, help="xgrammar fill threads (default: half the cores)")
    p.add_argument("--vocab-file", default=None,
                   help="a real vocabulary for the grammar: tekken_240911.json or a mistral_common wheel "
                        "(default: the synthetic one, a worst case)")
    p.add_argument("--smoke", action="store_true", help="CPU, the embedded model, toy sizes: checks the logic")
    p.add_argument("--out", default="structured.json")
    a = p.parse_args(argv)
    if a.smoke:
        a.ctx, a.steps = min(a.ctx, 32), min(a.steps, 3)
    elif not torch.cuda.is_available():
        sys.exit("bench/structured.py needs a CUDA device (or --smoke)")
    Bench(a).run()


if __name__ == "__main__":
    main()
