"""Owns the model, the KV pool and the attention backend of one worker; runs forwards."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from sglang_ext.attention import get_backend_class
from sglang_ext.engine.cuda_graph import DEFAULT_MAX_BS, CudaGraphRunner
from sglang_ext.engine.forward_batch import ForwardBatch
from sglang_ext.kvcache.pool import KVGeometry, KVPool
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.loader import load_model
from sglang_ext.server_args import ServerArgs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_DEFAULT_TOKENS = 65536


def resolve_dtype(args: ServerArgs, cfg: ModelConfig, device: str) -> torch.dtype:
    if args.dtype != "auto":
        return _DTYPES[args.dtype]
    if device.startswith("cuda"):
        return torch.float16 if cfg.torch_dtype == "float16" else torch.bfloat16
    return torch.float32


def context_length(args: ServerArgs, cfg: ModelConfig) -> int:
    n = args.context_length or cfg.max_position_embeddings
    if cfg.sliding_window:  # no sliding-window kernel: cap the context so attention stays exact
        n = min(n, cfg.sliding_window)
    return n


class ModelRunner:
    def __init__(self, args: ServerArgs, model_dir: Path, cfg: ModelConfig) -> None:
        self.args = args
        self.cfg = cfg
        self.device = torch.device(args.resolved_device)
        self.dtype = resolve_dtype(args, cfg, args.resolved_device)
        self.context_len = context_length(args, cfg)
        load_format = "dummy" if args.load_format == "dummy" else "safetensors"
        torch.manual_seed(args.random_seed)
        self.model = load_model(
            model_dir, cfg, load_format, self.dtype, self.device,
            max_positions=max(self.context_len, cfg.max_position_embeddings), seed=args.random_seed,
        )
        geom = KVGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.resolved_page_size, self.dtype)
        self.num_pages = self._num_pages(geom)
        self.pool = KVPool(geom, self.num_pages, self.device)
        backend_cls = get_backend_class(args.resolved_attention_backend)
        self.attn = backend_cls(self.pool, cfg.num_heads, cfg.head_dim, cfg.head_dim**-0.5)
        self.graphs: CudaGraphRunner | None = None
        logger.info(
            "model %s on %s/%s, KV pool %d pages x %d tokens (%.1f MiB), attention=%s",
            cfg.architecture, self.device, self.dtype, self.num_pages, geom.page_size,
            self.pool.total_bytes / 2**20, args.resolved_attention_backend,
        )
        self.init_cuda_graphs()

    def init_cuda_graphs(self) -> None:
        """Capture decode graphs (CUDA, a backend that supports them, not --disable-cuda-graph)."""
        self.graphs = None
        a = self.args
        if self.device.type != "cuda" or a.disable_cuda_graph or not self.attn.supports_cuda_graph():
            return
        max_bs = a.cuda_graph_max_bs or DEFAULT_MAX_BS
        if a.max_running_requests:
            max_bs = min(max_bs, a.max_running_requests)
        if max_bs < 1:
            return
        pages_per_req = -(-self.context_len // self.pool.page_size)
        self.graphs = CudaGraphRunner(self.model, self.attn, self.device, max_bs, pages_per_req)

    def _num_pages(self, geom: KVGeometry) -> int:
        a = self.args
        if a.max_total_tokens is not None:
            return -(-a.max_total_tokens // geom.page_size) + 1  # +1: page 0 is reserved
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # memory this process cached but no longer uses counts as free
            free, total = torch.cuda.mem_get_info(self.device)
            frac = a.mem_fraction_static or 0.85
            budget = free - total * (1.0 - frac)
            if budget <= geom.page_bytes * 2:
                raise RuntimeError(
                    f"no GPU memory left for the KV cache: free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB "
                    f"at mem_fraction_static={frac}; lower it or pass --max-total-tokens"
                )
            return int(budget // geom.page_bytes)
        tokens = _CPU_DEFAULT_TOKENS
        if a.mem_fraction_static is not None:
            # On CPU the fraction is of physical RAM, minus what the weights already take.
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            budget = ram * a.mem_fraction_static - weights
            if budget <= geom.page_bytes * 2:
                raise RuntimeError(f"mem_fraction_static={a.mem_fraction_static} leaves no RAM for the KV cache")
            return int(budget // geom.page_bytes)
        return -(-tokens // geom.page_size) + 1

    @property
    def max_total_tokens(self) -> int:
        return (self.num_pages - 1) * self.pool.page_size

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] in float32."""
        batch.attn_backend = self.attn
        if self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.replay(batch)
        else:
            self.attn.prepare(batch)
            hidden = self.model(batch)
        return self.model.compute_logits(hidden)
