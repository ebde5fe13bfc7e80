"""Offline GPU benchmark of the engine's fast path against the hardware's limits.

    python bench/offline.py --model-path preset:llama-3-8b --load-format dummy --out offline.json

Drives `ModelRunner` (real model, KV pool, FlashInfer backend, CUDA graphs, fused ops) with
synthetic batches and reports, for decode at every (context, batch size):
  step_ms      back-to-back decode steps (forward + greedy argmax), events over many steps
  graph_ms     the decode CUDA graph alone (attention metadata already planned)
  cpu_ms       host time of one `runner.forward` (plan + copies + replay + LM head launch)
  serial_ms    forward + synchronize per step: what a loop without overlap pays (CPU + GPU)
  eager_ms     the same step without CUDA graphs
  build_ms     the scheduler's `build_batch` for this batch (CPU; overlap scheduling hides it)
  roofline_ms  (weight bytes + KV bytes read) / HBM read bandwidth measured in this run; for an MoE
               model the weight bytes are the dense weights plus the experts this batch's tokens hit
               (counted per layer from one eager forward: `experts_hit`), not every expert;
               `--moe-routing-simulation uniform` routes at random as the serving runs do
plus attention alone (tensor-core vs CUDA-core decode), variants (fused ops off, the other decode
kernel), prefill tokens/s against the dense-FLOP roofline, the scheduler loop with and without
overlap, and a per-kernel profile of one decode step naming the largest gap to the roofline (for an
MoE: routing, expert GEMMs and attention apart; `--profile-ctx 2048,8192` gives the share of the
step spent in attention at each context, where moving attention pays).

    python bench/offline.py --model-path preset:mixtral-8x7b --contexts 1024,8192 --profile-ctx 2048,8192
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, get_args
from unittest import mock

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tqdm import tqdm

from bench.gpu_measure import (  # the repo root is on sys.path above when run as a script
    PAGE,
    Layout,
    build_ms,
    decode_batch,
    gemm_peak,
    hbm_read_bw,
    kernel_category,
    prefill_batch,
    time_gpu,
)
from bench.provenance import provenance
from bench.sim.geometry import Geometry
from sglang_ext import ops
from sglang_ext.engine.cuda_graph import CudaGraphRunner
from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.forward_batch import ForwardBatch
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.resolve import resolve_model_path
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler
from sglang_ext.server_args import MoERoutingSimulation, ServerArgs

# Room kept free beside the weights and the pool: CUDA graphs, activations of an 8K prefill, workspaces.
POOL_MARGIN_BYTES = 4 << 30


def kv_tokens_that_fit(requested: int, free_bytes: int, geo: Geometry, margin_bytes: int = POOL_MARGIN_BYTES) -> int:
    """The KV pool to allocate: `requested` tokens, or fewer where they would not fit beside the model's
    weights in `free_bytes` (the GPU's free memory before loading). The sweep's default pool is an H200's;
    on an H100 Qwen3-30B-A3B's 57 GiB of weights left no room for it and the run died at set-up (2026-12-07).
    Decode points the smaller pool cannot hold are skipped and listed, as with --max-kv-tokens."""
    # every expert resident, + the input embedding (bf16), counted even where tied
    weights = geo.weight_read_bytes(0, experts_hit=geo.num_experts) + 2 * geo.vocab * geo.hidden
    # Geometry's byte counts are floats (they price fractions of experts): the pool's size is an int
    room = int((free_bytes - weights - margin_bytes) // geo.kv_bytes_per_token)
    return max(min(requested, room), 0)


class PrefillShape(NamedTuple):
    """A prefill forward of the prefill section: `reqs` chunks of `length` new tokens, each after `prefix`
    tokens already in the pool, with `rows` decode rows at context `ctx` riding along (serving's mixed
    forwards). bench/sim/fit.py fits a dense model's prefill rates to lone prompts from position 0 only, an
    MoE's also to lone chunks after a prefix (fit.equal_token_pairs); the rest validate its pricing."""

    reqs: int
    length: int
    prefix: int = 0
    rows: int = 0
    ctx: int = 0


_SHAPE = re.compile(r"(\d+)x(\d+)(?:@(\d+))?(?:\+(\d+)d(\d+))?")


def parse_shapes(text: str) -> list[PrefillShape]:
    """"1x1024,4x2048,1x1024@4096,1x2048+24d6000" -> PrefillShapes: REQSxLEN, then optionally @PREFIX (the
    tokens before each chunk) and +ROWSdCTX (decode rows riding along and their context)."""
    out = []
    for part in text.split(","):
        m = _SHAPE.fullmatch(part.strip().lower())
        shape = PrefillShape(*(int(g) for g in m.groups(default="0"))) if m else None
        if shape is None or shape.reqs < 1 or shape.length < 1 or (shape.rows > 0) != (shape.ctx > 0):
            raise ValueError(f"prefill shape {part!r}: expected REQSxLEN[@PREFIX][+ROWSdCTX], e.g. 1x1024, "
                             f"1x1024@4096 or 1x2048+24d6000")
        out.append(shape)
    return out


def _shapes_arg(text: str) -> list[PrefillShape]:
    try:
        return parse_shapes(text)
    except ValueError as e:  # argparse prints an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(e)) from None


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.res: dict[str, Any] = {"errors": {}}
        self.bs_list = [int(x) for x in a.batch_sizes.split(",")]
        self.ctx_list = [int(x) for x in a.contexts.split(",")]

    def setup(self) -> None:
        a = self.a
        reads = hbm_read_bw()
        self.bw = max(reads.values())
        self.peak = gemm_peak()
        torch.cuda.empty_cache()
        model_dir = resolve_model_path(a.model_path)
        self.cfg = cfg = ModelConfig.from_path(model_dir)
        tokens = max(self.bs_list) * max(self.ctx_list) + 8192 + 64 * PAGE
        if a.max_kv_tokens:  # a big model (Mixtral: 87 GiB of weights) leaves room for fewer: points skipped
            tokens = min(tokens, a.max_kv_tokens)
        fits = kv_tokens_that_fit(tokens, torch.cuda.mem_get_info()[0], Geometry.from_model_config(cfg))
        if fits < tokens:
            print(f"KV pool {fits} tokens, not {tokens}: no more fits beside the weights on this GPU "
                  "(decode points that need more are skipped)", file=sys.stderr)
            tokens = fits  # decode and attention points check the pool they get (`fits`)
        self.args = ServerArgs(model_path=a.model_path, load_format=a.load_format, device="cuda", dtype="bfloat16",
                               page_size=PAGE, max_total_tokens=tokens, cuda_graph_max_bs=max(self.bs_list),
                               attention_backend=a.attention_backend, skip_tokenizer_init=True,
                               moe_routing_simulation=a.moe_routing_simulation)
        t0 = time.perf_counter()
        self.runner = ModelRunner(self.args, model_dir, cfg)
        init_s = time.perf_counter() - t0
        self.runner.pool.data.normal_()  # never time attention on zeros
        self.count_weights(cfg, self.runner.model)
        self.layout = Layout(self.runner.num_pages)
        gpu = torch.cuda.get_device_properties(0)
        self.res["env"] = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": gpu.name,
            **provenance(),  # git_commit, git_dirty, commit_source, call_id: the tree that really ran
            "sms": gpu.multi_processor_count, "torch": torch.__version__, "cuda": torch.version.cuda,
            "flashinfer": _version("flashinfer"), "triton": _version("triton"), "python": platform.python_version(),
            "model": a.model_path, "layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "attention_backend": self.args.resolved_attention_backend,
            "decode_tensor_cores": getattr(self.runner.attn, "decode_tc", None),
            "hbm_read_TBps": self.bw / 1e12, "hbm_reads_TBps": {k: v / 1e12 for k, v in reads.items()},
            "bf16_gemm_TFLOPs": self.peak / 1e12,
            "weight_GB": self.weight_bytes / 1e9, "dense_weight_GB": self.dense_bytes / 1e9,
            "moe": None if cfg.moe is None else {"experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
                                                 "expert_intermediate": cfg.moe.intermediate_size,
                                                 "sparse_layers": sum(cfg.moe.sparse_layers)},
            "active_params_B": cfg.active_params() / 1e9, "runner_init_s": init_s,
            "moe_routing_simulation": a.moe_routing_simulation,
            "graph_sizes": self.runner.graphs.sizes if self.runner.graphs else None,
        }

    def count_weights(self, cfg: ModelConfig, model: torch.nn.Module) -> None:
        """Weight bytes a decode step reads (the LM head, not the embedding table, unless tied); for an
        MoE, the routed experts' bytes apart, since a step reads only the experts its tokens hit."""
        from sglang_ext.models.moe import Experts

        self.cfg = cfg
        self.weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                                if cfg.tie_word_embeddings or not n.startswith("embed_tokens"))
        self.kv_token_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
        self.experts = [m for m in model.modules() if isinstance(m, Experts)]
        self.expert_bytes = [(m.gate_up_proj[0].numel() + m.down_proj[0].numel()) * m.gate_up_proj.element_size()
                             for m in self.experts]
        self.dense_bytes = self.weight_bytes - sum(b * m.num_local for b, m in zip(self.expert_bytes, self.experts,
                                                                                     strict=True))

    def experts_hit(self, batch: ForwardBatch) -> list[int]:
        """Distinct experts each MoE layer's router picks for `batch` (one eager forward, hooks on the
        expert modules; routing is deterministic, so the graph replays hit the same ones)."""
        if not self.experts:
            return []
        hits: list[int] = []

        def hook(_m: Any, args: tuple[Any, ...]) -> None:
            hits.append(int(torch.unique(args[2]).numel()))

        handles = [m.register_forward_pre_hook(hook) for m in self.experts]
        graphs, self.runner.graphs = self.runner.graphs, None
        try:
            self.runner.forward(batch)
        finally:
            self.runner.graphs = graphs
            for h in handles:
                h.remove()
        return hits

    def weight_read_bytes(self, hit: list[int]) -> float:
        """Weight bytes one decode step must read: dense weights plus the experts hit (all weights for a
        dense model)."""
        if not self.experts:
            return self.weight_bytes
        return self.dense_bytes + sum(n * b for n, b in zip(hit, self.expert_bytes, strict=True))

    def roofline_ms(self, bs: int, ctx: int, hit: list[int] | None = None) -> float:
        emb = bs * self.cfg.hidden_size * 2
        w = self.weight_read_bytes(hit or [])
        return (w + emb + bs * ctx * self.kv_token_bytes) / self.bw * 1e3

    def roofline_flops_ms(self, bs: int, ctx: int, hit: list[int] | None = None) -> float:
        """The weights at max(bytes / bandwidth, FLOPs / GEMM peak), plus the KV read: at large batches
        the GEMMs turn compute-bound and the bytes-only roofline is unreachable. FLOPs count the
        parameters a token uses (k experts of an MoE layer)."""
        w = self.weight_read_bytes(hit or []) + bs * self.cfg.hidden_size * 2
        dense = max(w / self.bw, 2 * self.cfg.active_params() * bs / self.peak)
        return (dense + bs * ctx * self.kv_token_bytes / self.bw) * 1e3

    def fits(self, bs: int, ctx: int) -> bool:
        return bs * -(-ctx // PAGE) < self.runner.num_pages - 1

    def decode_if_fits(self, bs: int, ctx: int) -> None:
        if self.fits(bs, ctx):
            self.res["decode"].append(self.decode_point(bs, ctx))
        else:
            self.res["skipped"].append({"bs": bs, "ctx": ctx, "why": f"KV pool holds {self.runner.num_pages} pages"})

    def attention_if_fits(self, bs: int, ctx: int) -> None:
        if self.fits(bs, ctx):  # a pool cut to what the card holds (kv_tokens_that_fit) skips the point
            self.res["attention"].append(self.attention_point(bs, ctx))

    def decode_point(self, bs: int, ctx: int) -> dict[str, Any]:
        r = self.runner
        pages = self.layout.pages(bs, ctx)
        batch = decode_batch(pages, ctx, self.cfg.vocab_size)

        def step() -> None:
            r.forward(batch).argmax(-1)

        out: dict[str, Any] = {"bs": bs, "ctx": ctx}
        out["step_ms"] = time_gpu(step, self.a.steps)
        host, wall = [], []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r.forward(batch)
            host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - t0)
        out["cpu_ms"] = statistics.median(host) * 1e3
        out["serial_ms"] = statistics.median(wall) * 1e3
        if r.graphs is not None:
            from sglang_ext.engine.cuda_graph import padded_size

            g = r.graphs.graphs[padded_size(r.graphs.sizes, bs)]  # type: ignore[index]
            out["graph_ms"] = time_gpu(g.replay, self.a.steps)
            graphs, r.graphs = r.graphs, None
            try:
                out["eager_ms"] = time_gpu(step, max(self.a.steps // 2, 3), warmup=1)
                t0 = time.perf_counter()
                r.forward(batch)
                out["eager_cpu_ms"] = (time.perf_counter() - t0) * 1e3
            finally:
                r.graphs = graphs
        out["build_ms"] = build_ms(pages, ctx)
        hit = self.experts_hit(batch)
        if hit:
            out["experts_hit"] = statistics.mean(hit)
            out["weight_read_GB"] = self.weight_read_bytes(hit) / 1e9
        out["roofline_ms"] = self.roofline_ms(bs, ctx, hit)
        out["roofline_flops_ms"] = self.roofline_flops_ms(bs, ctx, hit)
        out["frac_of_roofline"] = out["roofline_ms"] / out["step_ms"]
        out["tok_per_s"] = bs / out["step_ms"] * 1e3
        return out

    def layout_points(self) -> list[dict[str, Any]]:
        """bs 64 decode with scattered vs consecutive page ids and page-aligned vs ragged lengths
        (the scheduler's allocator hands out consecutive pages; the sweep above uses scattered)."""
        rows = []
        bs = 64
        for ctx in (1024, 1040, 1088):
            n = -(-ctx // PAGE)
            for kind in ("scattered", "consecutive"):
                if kind == "scattered":
                    pages = self.layout.pages(bs, ctx)
                else:
                    pages = [list(range(1 + i * n, 1 + (i + 1) * n)) for i in range(bs)]
                batch = decode_batch(pages, ctx, self.cfg.vocab_size)
                ms = time_gpu(lambda batch=batch: self.runner.forward(batch).argmax(-1), self.a.steps)
                rows.append({"bs": bs, "ctx": ctx, "pages": kind, "step_ms": ms})
        return rows

    def attention_point(self, bs: int, ctx: int) -> dict[str, Any]:
        """Decode attention alone over all layers' KV (CUDA-core vs tensor-core kernels)."""
        from sglang_ext.attention.flashinfer_backend import FlashInferAttentionBackend

        cfg, pool = self.cfg, self.runner.pool
        batch = decode_batch(self.layout.pages(bs, ctx), ctx, cfg.vocab_size)
        q = torch.randn(bs, cfg.num_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
        out: dict[str, Any] = {"bs": bs, "ctx": ctx}
        kv_bytes = bs * ctx * 2 * cfg.num_kv_heads * cfg.head_dim * 2
        for tc in (False, True):
            be = FlashInferAttentionBackend(pool, cfg.num_heads, cfg.head_dim, cfg.head_dim**-0.5,
                                            decode_tensor_cores=tc)
            be.prepare(batch)
            w = batch.attn_meta.wrapper  # type: ignore[union-attr]
            views = [pool.layer_view(i) for i in range(cfg.num_layers)]
            ms = time_gpu(lambda w=w, views=views: [w.run(q, v) for v in views], 5) / cfg.num_layers
            key = "tc" if tc else "cuda_core"
            out[f"{key}_us"] = ms * 1e3
            out[f"{key}_TBps"] = kv_bytes / (ms / 1e3) / 1e12
            del be
        return out

    def variants(self) -> list[dict[str, Any]]:
        """Step time with one choice flipped (graphs recaptured): fused ops off; other decode kernel."""
        from sglang_ext.attention.flashinfer_backend import FlashInferAttentionBackend

        r, cfg = self.runner, self.cfg
        points = [(b, c) for b, c in ((1, 1024), (8, 2048), (64, 2048), (256, 1024), (256, 2048))
                  if b in self.bs_list and c in self.ctx_list]
        rows = []
        base_attn, base_graphs = r.attn, r.graphs
        pages_per_req = -(-r.context_len // PAGE)
        for name in ("fused_ops_off", "other_decode_kernel"):
            r.graphs = None
            torch.cuda.empty_cache()
            with ExitStack() as undo:
                if name == "fused_ops_off":
                    # Every caller asks ops.use_fused at call time: answering no runs the torch reference.
                    undo.enter_context(mock.patch.object(ops, "use_fused", return_value=False))
                else:
                    r.attn = FlashInferAttentionBackend(r.pool, cfg.num_heads, cfg.head_dim, cfg.head_dim**-0.5,
                                                        decode_tensor_cores=not base_attn.decode_tc)
                try:
                    r.graphs = CudaGraphRunner(r.model, r.attn, r.device, max(self.bs_list), pages_per_req)
                    for bs, ctx in points:
                        batch = decode_batch(self.layout.pages(bs, ctx), ctx, cfg.vocab_size)
                        ms = time_gpu(lambda batch=batch: r.forward(batch).argmax(-1), self.a.steps)
                        rows.append({"variant": name, "bs": bs, "ctx": ctx, "step_ms": ms,
                                     "decode_tensor_cores": r.attn.decode_tc})
                finally:
                    r.graphs = None
                    r.attn = base_attn
                    torch.cuda.empty_cache()
        r.graphs = base_graphs
        return rows

    def prefill(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        # parameters a token multiplies by (k experts of an MoE layer); the LM head runs on R rows only
        layer_params = cfg.active_params() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        rows = []
        for reqs, length, prefix, drows, dctx in self.a.prefill_shapes:
            pages = self.layout.pages_each([prefix + length] * reqs + [dctx] * drows)
            batch = prefill_batch(pages[:reqs], length, cfg.vocab_size, prefix,
                                  [(p, dctx) for p in pages[reqs:]])
            ms = time_gpu(lambda batch=batch: self.runner.forward(batch), 5, warmup=2)
            t = reqs * length
            # causal pairs: each new token attends over the prefix and the chunk up to itself
            pairs = reqs * (length * prefix + length * (length + 1) // 2)
            flops = 2 * layer_params * (t + drows) + 2 * cfg.vocab_size * cfg.hidden_size * (reqs + drows) \
                + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs
            roof = flops / self.peak * 1e3
            row = {"reqs": reqs, "len": length, "ms": ms, "tok_per_s": t / ms * 1e3,
                   "roofline_ms": roof, "frac_of_roofline": roof / ms, "TFLOPs": flops / ms / 1e9}
            if prefix or drows:  # kept out of the older rows' keys: their readers see lone prompts only
                row.update(prefix=prefix, decode_rows=drows, decode_ctx=dctx)
            rows.append(row)
        return rows

    SAMPLING: ClassVar[dict[str, dict[str, Any]]] = {
        "greedy": {"temperature": 0.0},
        # the sampled row of docs/benchmarks.md: every filter and a penalty, unseeded
        "sampled": {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "frequency_penalty": 0.5},
    }

    def loop(self) -> list[dict[str, Any]]:
        """The scheduler loop end to end (build, forward, sample, finish), with and without overlap,
        greedy and sampled, at each --loop-requests batch size."""
        rows = []
        plen, out_len = self.a.loop_prompt, self.a.loop_output
        for n in (int(x) for x in str(self.a.loop_requests).split(",")):
            for mode in self.a.loop_sampling.split(","):
                for overlap in (False, True):
                    rows.append(self._loop_run(overlap, n, plen, out_len, mode))
        return rows

    def _loop_run(self, overlap: bool, n: int, plen: int, out_len: int, mode: str) -> dict[str, Any]:
        name = "OverlapScheduler" if overlap else "Scheduler"  # the labels of earlier results
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(10, self.cfg.vocab_size, (plen,), generator=g).tolist() for _ in range(n)]
        real_forward = self.runner.forward
        s = Scheduler(self.args, self.runner, PAGE, frozenset(), vocab_size=self.cfg.vocab_size, overlap=overlap)
        sp = SamplingParams(max_new_tokens=out_len, ignore_eos=True, **self.SAMPLING[mode])
        for i, p in enumerate(prompts):
            s.add_request(Req(f"{name}-{mode}-{i}", p, sp))
        fwd_host: list[float] = []
        fwd_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

        def timed_forward(batch: ForwardBatch) -> torch.Tensor:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            out = real_forward(batch)
            fwd_host.append(time.perf_counter() - t0)
            e1.record()
            if batch.mode.is_decode:
                fwd_events.append((e0, e1))
            return out

        self.runner.forward = timed_forward  # type: ignore[method-assign]
        started: set[str] = set()
        t_first, decode_tokens, steps = None, 0, 0
        t0 = time.perf_counter()
        try:
            while s.has_work():
                for o in s.step():
                    if t_first is not None:
                        decode_tokens += len(o.new_token_ids)
                    elif o.new_token_ids:
                        started.add(o.rid)
                if t_first is not None:
                    steps += 1
                elif len(started) == n:
                    t_first = time.perf_counter()  # every request has its first token: decode phase
            torch.cuda.synchronize()
        finally:
            del self.runner.forward  # back to the method
        t1 = time.perf_counter()
        dec_s = t1 - (t_first or t0)
        gpu = [a.elapsed_time(b) for a, b in fwd_events[-steps:]] if steps else []
        s.flush_cache()
        return {"scheduler": name, "sampling": mode, "requests": n, "prompt": plen, "output": out_len,
                "total_s": t1 - t0, "decode_s": dec_s, "decode_steps": steps, "decode_tokens": decode_tokens,
                "decode_tok_per_s": decode_tokens / dec_s if dec_s > 0 else None,
                "step_wall_ms": dec_s / steps * 1e3 if steps else None,
                "forward_gpu_ms_median": statistics.median(gpu) if gpu else None,
                "forward_host_ms_median": statistics.median(fwd_host[-steps:]) * 1e3 if steps else None,
                "overlapped_steps": s.overlapped_steps}

    def profile(self, bs: int, ctxs: list[int]) -> dict[str, Any]:
        """The first context with and without graphs; the others with graphs (the attention share). A
        context whose batch does not fit the pool is profiled at the largest halved batch that does
        (Mixtral at ctx 8K: 300K KV tokens hold 36 rows, so bs 32); each row records its bs. Filled in as it goes, so
        a later failure keeps the earlier contexts."""
        out: dict[str, Any] = self.res.setdefault("profile", {})

        def fitting(ctx: int) -> int:
            b = bs
            while b > 1 and not self.fits(b, ctx):
                b //= 2
            return b

        out["graph"] = self._profile(fitting(ctxs[0]), ctxs[0])
        graphs, self.runner.graphs = self.runner.graphs, None
        try:
            out["eager"] = self._profile(fitting(ctxs[0]), ctxs[0])
        finally:
            self.runner.graphs = graphs
        for ctx in ctxs[1:]:
            out[f"graph_ctx{ctx}"] = self._profile(fitting(ctx), ctx)
        # prefill (eager, as served): one 1024-token request, where an MoE model's fixed costs show
        prefill = prefill_batch(self.layout.pages(1, 1024), 1024, self.cfg.vocab_size)
        cats, kernels = self._kernels(lambda: self.runner.forward(prefill), steps=3)
        out["prefill_1x1024"] = {"kernel_us_per_step": sum(cats.values()), "by_category_us": cats,
                                 "top_kernels": kernels[:15]}
        return out

    def _kernels(self, step: Callable[[], Any], steps: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Device time per step by kernel category (gpu_measure.kernel_category), and the kernels
        slowest first, from the torch profiler over `steps` calls of `step` after 3 warm-up calls."""
        from torch.profiler import ProfilerActivity, profile

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        kernels = []
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0.0)
            if us > 0:
                kernels.append({"name": e.key[:120], "us_per_step": us / steps, "calls_per_step": e.count / steps,
                                "category": kernel_category(e.key)})
        kernels.sort(key=lambda k: -k["us_per_step"])
        cats: dict[str, float] = {}
        for k in kernels:
            cats[k["category"]] = cats.get(k["category"], 0.0) + k["us_per_step"]
        return cats, kernels

    def _profile(self, bs: int, ctx: int) -> dict[str, Any]:
        batch = decode_batch(self.layout.pages(bs, ctx), ctx, self.cfg.vocab_size)
        cats, kernels = self._kernels(lambda: self.runner.forward(batch).argmax(-1), steps=5)
        kv = bs * ctx * self.kv_token_bytes
        hit = self.experts_hit(batch)
        ideal = {"gemm": self.dense_bytes / self.bw * 1e6, "attention": kv / self.bw * 1e6}
        if hit:
            ideal["moe_experts"] = (self.weight_read_bytes(hit) - self.dense_bytes) / self.bw * 1e6
        gaps = {c: t - ideal.get(c, 0.0) for c, t in cats.items()}
        total = sum(cats.values())
        return {"bs": bs, "ctx": ctx, "kernel_us_per_step": total, "by_category_us": cats,
                "attention_share": cats.get("attention", 0.0) / total if total else None,
                "ideal_us": ideal, "gap_us": gaps, "largest_gap": max(gaps, key=gaps.__getitem__) if gaps else None,
                "top_kernels": kernels[:25]}

    def run(self) -> dict[str, Any]:
        a = self.a
        points = [(b, c) for c in self.ctx_list for b in self.bs_list]
        self.res["skipped"] = []
        want = set(a.sections.split(","))
        tasks: list[tuple[str, Callable[[], Any]]] = [("setup", self.setup)]
        self.res["decode"], self.res["attention"] = [], []
        if "decode" in want:
            tasks += [(f"decode bs={b} ctx={c}",
                       lambda b=b, c=c: self.decode_if_fits(b, c)) for b, c in points]
        if "layout" in want:
            tasks.append(("layout", lambda: self.res.__setitem__("layout", self.layout_points())))
        if "flashinfer" in str(a.attention_backend or "flashinfer"):
            if "attention" in want:
                tasks += [(f"attention bs={b} ctx={c}",
                           lambda b=b, c=c: self.attention_if_fits(b, c))
                          for b, c in points if b * -(-c // PAGE) <= (a.max_kv_tokens or b * c) // PAGE]
            if "variants" in want:
                tasks.append(("variants", lambda: self.res.__setitem__("variants", self.variants())))
        if "prefill" in want:
            tasks.append(("prefill", lambda: self.res.__setitem__("prefill", self.prefill())))
        if "loop" in want:
            tasks.append(("loop", lambda: self.res.__setitem__("loop", self.loop())))
        if "profile" in want:
            tasks.append(("profile",
                          lambda: self.res.__setitem__("profile", self.profile(
                              a.profile_bs, [int(c) for c in str(a.profile_ctx).split(",")]))))
        bar = tqdm(tasks, desc="offline bench", file=sys.stderr)
        for name, fn in bar:
            bar.set_postfix_str(name)
            try:
                fn()
            except Exception:
                self.res["errors"][name] = traceback.format_exc(limit=6)
                if name == "setup":
                    break
            finally:  # partial results survive a timeout
                Path(a.out).write_text(json.dumps(self.res, indent=1))
        return self.res


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:
        return None


def summary(res: dict[str, Any]) -> str:
    lines = []
    env = res.get("env", {})
    lines.append(f"{env.get('gpu')}  HBM read {env.get('hbm_read_TBps', 0):.2f} TB/s  "
                 f"bf16 GEMM {env.get('bf16_gemm_TFLOPs', 0):.0f} TFLOP/s  weights {env.get('weight_GB', 0):.2f} GB  "
                 f"decode tensor cores: {env.get('decode_tensor_cores')}")
    lines.append(f"{'ctx':>5} {'bs':>4} {'step':>7} {'graph':>7} {'roof':>7} {'%roof':>6} {'%roofF':>6} {'tok/s':>8} "
                 f"{'cpu':>6} {'serial':>7} {'eager':>7} {'build':>6}   (ms)")
    for d in res.get("decode", []):
        lines.append(f"{d['ctx']:>5} {d['bs']:>4} {d['step_ms']:7.2f} {d.get('graph_ms', math.nan):7.2f} "
                     f"{d['roofline_ms']:7.2f} {100 * d['frac_of_roofline']:5.1f}% "
                     f"{100 * d['roofline_flops_ms'] / d['step_ms']:5.1f}% {d['tok_per_s']:8.0f} "
                     f"{d['cpu_ms']:6.2f} {d['serial_ms']:7.2f} {d.get('eager_ms', math.nan):7.2f} "
                     f"{d['build_ms']:6.2f}")
    for at in res.get("attention", []):
        lines.append(f"attn ctx={at['ctx']} bs={at['bs']}: cuda-core {at['cuda_core_us']:.0f} us "
                     f"({at['cuda_core_TBps']:.2f} TB/s), tensor-core {at['tc_us']:.0f} us ({at['tc_TBps']:.2f} TB/s)")
    for v in res.get("variants", []):
        lines.append(f"variant {v['variant']} (tc={v['decode_tensor_cores']}) ctx={v['ctx']} bs={v['bs']}: "
                     f"{v['step_ms']:.2f} ms")
    for lo in res.get("layout", []):
        lines.append(f"layout bs={lo['bs']} ctx={lo['ctx']} {lo['pages']} pages: {lo['step_ms']:.2f} ms")
    for p in res.get("prefill", []):
        shape = f"{p['reqs']}x{p['len']}" + (f"@{p['prefix']}" if p.get("prefix") else "") \
            + (f"+{p['decode_rows']}d{p['decode_ctx']}" if p.get("decode_rows") else "")
        lines.append(f"prefill {shape}: {p['ms']:.1f} ms, {p['tok_per_s']:.0f} tok/s, "
                     f"{p['TFLOPs']:.0f} TFLOP/s = {100 * p['frac_of_roofline']:.0f}% of roofline")
    for lp in res.get("loop", []):
        lines.append(f"loop {lp['scheduler']} {lp.get('sampling', 'greedy')} bs={lp['requests']}: "
                     f"decode {lp['decode_tok_per_s'] or 0:.0f} tok/s "
                     f"({lp['requests']} reqs x {lp['output']} tokens, overlapped steps {lp['overlapped_steps']}); "
                     f"per step: wall {lp['step_wall_ms'] or 0:.2f} ms, forward on GPU "
                     f"{lp['forward_gpu_ms_median'] or 0:.2f} ms, "
                     f"forward on host {lp['forward_host_ms_median'] or 0:.2f} ms")
    for mode, pr in (res.get("profile") or {}).items():
        cats = ", ".join(f"{k} {v:.0f}" for k, v in sorted(pr["by_category_us"].items(), key=lambda kv: -kv[1]))
        share, gap = pr.get("attention_share"), pr.get("largest_gap")
        # a prefill profile has no batch geometry, share or roofline gap (they are decode figures)
        where = f" bs={pr['bs']} ctx={pr['ctx']}" if "bs" in pr else ""
        tail = "" if share is None else f"; attention {100 * share:.0f}% of kernel time"
        tail += "" if gap is None else f"; largest gap: {gap} (+{pr['gap_us'].get(gap, 0):.0f} us)"
        lines.append(f"profile[{mode}]{where}: {pr['kernel_us_per_step']:.0f} us/step ({cats}){tail}")
        for k in pr["top_kernels"][:8]:
            lines.append(f"   {k['us_per_step']:8.1f} us x{k['calls_per_step']:.0f}  {k['name'][:90]}")
    for sk in res.get("skipped", []):
        lines.append(f"skipped bs={sk['bs']} ctx={sk['ctx']}: {sk['why']}")
    for name, err in res.get("errors", {}).items():
        lines.append(f"ERROR in {name}: {err.strip().splitlines()[-1]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="preset:llama-3-8b")
    p.add_argument("--load-format", default="dummy", choices=["dummy", "auto", "safetensors"])
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    p.add_argument("--contexts", default="1024,2048")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-kv-tokens", type=int, default=None,
                   help="cap the KV pool (a large model leaves less memory); decode points that do not fit are "
                        "skipped and listed")
    p.add_argument("--moe-routing-simulation", default="off", choices=get_args(MoERoutingSimulation),
                   help="uniform: every token picks top-k experts at random, as the serving runs of dummy "
                        "weights do (the dummy router's own choice is skewed; decode steps then differ); each "
                        "graph replay draws anew, so experts_hit is one eager draw's count")
    p.add_argument("--profile-bs", type=int, default=64)
    p.add_argument("--profile-ctx", default="2048",
                   help="comma-separated contexts of the profile section (the first also without graphs)")
    p.add_argument("--prefill-shapes", type=_shapes_arg, default="1x1024,4x2048,1x8192",
                   help="the prefill section's forwards, comma-separated REQSxLEN[@PREFIX][+ROWSdCTX]: REQS chunks "
                        "of LEN tokens, each after PREFIX tokens in the pool, with ROWS decode rows at context CTX "
                        "riding along (serving's mixed forwards). bench/sim/fit.py fits its prefill rates to the "
                        "single-request rows without riding rows (a prefix only for an MoE); the others validate "
                        "its pricing")
    p.add_argument("--loop-requests", default="64", help="comma-separated batch sizes of the loop section")
    p.add_argument("--loop-sampling", default="greedy,sampled", help="greedy and/or sampled (see Bench.SAMPLING)")
    p.add_argument("--loop-prompt", type=int, default=1024)
    p.add_argument("--loop-output", type=int, default=64)
    p.add_argument("--sections", default="decode,layout,attention,variants,prefill,loop,profile",
                   help="comma-separated subset to run")
    p.add_argument("--out", default="offline.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/offline.py needs a CUDA device")
    res = Bench(a).run()
    res["command"] = " ".join(["python", "bench/offline.py", *(argv if argv is not None else sys.argv[1:])])
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(summary(res))


if __name__ == "__main__":
    main()
