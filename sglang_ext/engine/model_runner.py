"""Owns the model, the KV pool and the attention backend of one worker; runs forwards."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Final

import torch

from sglang_ext import ops
from sglang_ext.attention import get_backend_class
from sglang_ext.engine import sm_partition
from sglang_ext.engine.cuda_graph import DEFAULT_MAX_BS, CudaGraphRunner
from sglang_ext.engine.split_attention import SplitAttention
from sglang_ext.forward_batch import ForwardBatch
from sglang_ext.kvcache.pool import KVGeometry, KVPool
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.expert_counts import ExpertCounts, attach_expert_counts
from sglang_ext.models.loader import load_model
from sglang_ext.models.moe import SparseMoeBlock, simulate_uniform_routing
from sglang_ext.server_args import ServerArgs

if TYPE_CHECKING:
    from sglang_ext.engine.split_attention import RemoteAttentionRows

logger = logging.getLogger("sglang_ext.startup")  # this module logs only startup stages

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_DEFAULT_TOKENS = 65536
# Backends that read only KV slots written before (FlashInfer bounds every read by the sequence
# length, the last page by kv_last_page_len): their pool is allocated uninitialised, since filling
# ~100 GB with zeros at startup is avoidable work. The torch backend gathers whole pages and
# masks the scores: a masked slot still meets its V through a zero weight, and 0 * NaN = NaN, so
# uninitialised garbage would poison real rows; its pool starts zeroed.
_READS_ONLY_WRITTEN_KV: Final = frozenset({"flashinfer"})


class StartupTimer:
    """Times the stages of a worker's startup and logs each as it ends, so a slow start says where
    its time went. GPU work is asynchronous: each stage synchronises before it is timed."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.stages: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str, device: torch.device | None = None) -> Iterator[list[str]]:
        notes: list[str] = []  # the stage appends details for its log line
        t = time.perf_counter()
        yield notes
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t
        self.stages[name] = self.stages.get(name, 0.0) + dt
        logger.info("%s %.2f s%s", name, dt, f" ({', '.join(notes)})" if notes else "")

    def summary(self) -> str:
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in self.stages.items())
        return f"{time.perf_counter() - self.t0:.2f} s ({parts})"


def bind_device(device: str) -> None:
    """Make `device` the calling thread's current CUDA device (nothing for a CPU device or a bare "cuda").
    The current device is per thread, and Triton launches on it: tensors of cuda:1 handed to a kernel
    while cuda:0 is current fail with "cannot be accessed from Triton". With an SM partition
    (`executor_reserved_sms`), the model's stream in it becomes the thread's current stream too."""
    if device.startswith("cuda:"):
        torch.cuda.set_device(torch.device(device))
        sm_partition.enter(torch.device(device))


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


def kv_budget_bytes(free: int, total: int, fraction: float, hosted: int = 0) -> int:
    """GPU bytes for the KV pool when it is sized from free memory: what is free beyond the
    (1 - fraction) of the GPU kept for activations and graphs, less `hosted` bytes set aside for the
    partition of executors this worker hosts (allocated after the pool; stages come on top of it)."""
    return int(free - total * (1.0 - fraction) - hosted)


def executor_set_aside(args: ServerArgs, device: torch.device) -> int:
    """Bytes of this GPU's memory fraction kept for an attention executor's partition, which is
    allocated after the KV pool: a hosted executor's (`executor_mem_gb`), and an in-process executor's on
    this same GPU (`--offload-executor local`), so that the worker with offload on uses the same share of
    the GPU as one without it -- a fair baseline. An in-process executor on another GPU takes nothing here."""
    if args.executor_mem_gb <= 0:
        return 0
    where = args.offload_executor
    if where is not None and where != "local":
        other = torch.device(where)
        if other.type != device.type or (other.index or 0) != (device.index or 0):
            return 0
    return int(args.executor_mem_gb * 2**30)


class ModelRunner:
    split: SplitAttention | None = None

    def __init__(self, args: ServerArgs, model_dir: Path, cfg: ModelConfig, timer: StartupTimer | None = None) -> None:
        self.args = args
        self.cfg = cfg
        self.device = torch.device(args.resolved_device)
        if args.executor_reserved_sms and self.device.type == "cuda" and (
                args.executor_mem_gb > 0 or args.offload_executor is not None):
            sm_partition.make(self.device, args.executor_reserved_sms)  # before anything runs on the model's stream
        if args.executor_max_sms and self.device.type == "cuda" and args.executor_mem_gb > 0:
            sm_partition.cap_executor(self.device, args.executor_max_sms)  # before an executor program exists
        bind_device(args.resolved_device)  # loading and graph capture run on this thread (the Engine's too)
        self.dtype = resolve_dtype(args, cfg, args.resolved_device)
        self.context_len = context_length(args, cfg)
        self.timer = timer or StartupTimer()
        load_format = "dummy" if args.load_format == "dummy" else "safetensors"
        torch.manual_seed(args.random_seed)
        with self.timer.stage("weights", self.device) as notes:
            self.model = load_model(
                model_dir, cfg, load_format, self.dtype, self.device,
                max_positions=max(self.context_len, cfg.max_position_embeddings), seed=args.random_seed,
            )
            if args.moe_routing_simulation == "uniform":
                if not simulate_uniform_routing(self.model):
                    raise ValueError(f"--moe-routing-simulation uniform: {cfg.architecture} has no MoE layers")
                notes.append("MoE routing simulated: uniform")
            # before the graphs are captured: they must hold the counting adds (models/expert_counts.py)
            self.expert_counts: ExpertCounts | None = None
            if args.expert_distribution_recorder_mode is not None:
                self.expert_counts = attach_expert_counts(self.model)
                if self.expert_counts is None:
                    raise ValueError(f"--expert-distribution-recorder-mode {args.expert_distribution_recorder_mode}: "
                                     f"{cfg.architecture} has no MoE layers")
                notes.append("expert distribution counted")
            nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
            n = cfg.num_params()
            params = f"{n / 1e9:.2f} B params" if n >= 1e9 else f"{n / 1e6:.1f} M params"
            notes += [load_format, params, f"{nbytes / 2**30:.2f} GiB",
                      f"{self.dtype}".removeprefix("torch."), str(self.device)]
        backend = args.resolved_attention_backend
        with self.timer.stage("kv pool", self.device) as notes:
            geom = KVGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.resolved_page_size, self.dtype)
            self.num_pages = self._num_pages(geom)
            zero = backend not in _READS_ONLY_WRITTEN_KV
            self.pool = KVPool(geom, self.num_pages, self.device, zero_fill=zero)
            notes += [f"{self.num_pages} pages x {geom.page_size} tokens", f"{self.pool.total_bytes / 2**30:.2f} GiB",
                      "zero-filled" if zero else "uninitialised"]
        with self.timer.stage("attention backend", self.device) as notes:
            backend_cls = get_backend_class(backend)
            self.attn = backend_cls(self.pool, cfg.num_heads, cfg.head_dim, cfg.head_dim**-0.5)
            notes.append(backend)
        self.graphs: CudaGraphRunner | None = None
        with self.timer.stage("cuda graphs", self.device) as notes:
            self.init_cuda_graphs()
            notes.append(f"{len(self.graphs.sizes)} batch sizes up to {self.graphs.max_bs}" if self.graphs else "none")
        moe = next((m for m in self.model.modules() if isinstance(m, SparseMoeBlock)), None)
        if moe is not None and self.device.type == "cuda":
            with self.timer.stage("moe kernels", self.device) as notes:
                notes.append(self._warm_moe(moe))

    @torch.inference_mode()
    def _warm_moe(self, block: SparseMoeBlock) -> str:
        """Build every MoE kernel variant a forward can use before serving (every layer shares them): the
        first batch to need an unbuilt one would otherwise wait seconds for Triton mid-run."""
        top = self.args.max_forward_tokens
        e = block.experts
        counts = ops.warm_moe(e.gate_up_proj, e.down_proj, block.moe.top_k, top, e.first_expert)
        return f"{len(counts)} block-size configs for 1-{top} tokens, built at {counts}"

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
            hosted = executor_set_aside(a, self.device)
            budget = kv_budget_bytes(free, total, frac, hosted)
            if budget <= geom.page_bytes * 2:
                raise RuntimeError(
                    f"no GPU memory left for the KV cache: free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB "
                    f"at mem_fraction_static={frac}"
                    + (f" with executor_mem_gb={a.executor_mem_gb:g} set aside" if hosted else "")
                    + "; lower it or pass --max-total-tokens"
                )
            return int(budget // geom.page_bytes)
        tokens = _CPU_DEFAULT_TOKENS
        if a.mem_fraction_static is not None:
            # On CPU the fraction is of physical RAM, minus what the weights already take.
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            ram_budget = ram * a.mem_fraction_static - weights
            if ram_budget <= geom.page_bytes * 2:
                raise RuntimeError(f"mem_fraction_static={a.mem_fraction_static} leaves no RAM for the KV cache")
            return int(ram_budget // geom.page_bytes)
        return -(-tokens // geom.page_size) + 1

    @property
    def max_total_tokens(self) -> int:
        return (self.num_pages - 1) * self.pool.page_size

    def set_remote(self, remote: RemoteAttentionRows) -> None:
        """Batches with remote rows attend through `SplitAttention` (local backend + executor)."""
        self.split = SplitAttention(self.attn, remote)
        if self.graphs is not None and remote.graph_capturable:
            from sglang_ext.engine.split_graph import SplitGraphs

            self.graphs.split = SplitGraphs(self.graphs, self.split)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] in float32."""
        if batch.split is not None:
            assert self.split is not None, "a batch with remote rows, but no executor"
            batch.attn_backend = self.split
            if self.graphs is not None and self.graphs.can_run(batch):
                return self.model.compute_logits(self.graphs.replay(batch))
            self.split.prepare(batch)
            return self.model.compute_logits(self.model(batch))
        batch.attn_backend = self.attn
        if self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.replay(batch)
        else:
            self.attn.prepare(batch)
            hidden = self.model(batch)
        return self.model.compute_logits(hidden)
