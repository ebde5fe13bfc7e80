"""Server arguments: one frozen dataclass built once from the CLI or from keywords.

Names follow SGLang's `ServerArgs` so a user's flags and `sglang.Engine(...)` keywords carry over.
Derived values are properties; per-process variants are made with `dataclasses.replace`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Final, Literal

DEFAULT_PORT: Final = 30000
ATTENTION_BACKENDS: Final = ("torch", "flashinfer")
SCHEDULE_POLICIES: Final = ("fcfs", "lpm")


@dataclass(frozen=True)
class ServerArgs:
    # model
    model_path: str | None = None  # None -> the embedded default model
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    skip_tokenizer_init: bool = False
    context_length: int | None = None
    random_seed: int = 0
    # device and memory
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    page_size: int | None = None  # None -> 16 (also on CPU, so prefix hits align the same way)
    # scheduling
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    max_prefill_tokens: int = 16384
    # kernels
    attention_backend: str | None = None  # None -> flashinfer on cuda when installed, else torch
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    disable_overlap_schedule: bool = False
    # serving
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    log_level: str = "info"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.page_size is not None and self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0:
            raise ValueError("chunked_prefill_size must be positive, or negative/None to disable")

    # ---- derived values -------------------------------------------------------------------
    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_page_size(self) -> int:
        return self.page_size or 16

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend:
            return self.attention_backend
        # FlashInfer has no float32 kernels: float32 on a GPU uses the exact torch backend.
        if self.resolved_device.startswith("cuda") and self.dtype != "float32":
            import importlib.util

            if importlib.util.find_spec("flashinfer") is not None:
                return "flashinfer"
        return "torch"

    @property
    def resolved_chunked_prefill_size(self) -> int | None:
        if self.chunked_prefill_size is None:
            # CPU: small chunks keep decode streams moving (a 2K-token chunk is ~1 s of CPU compute)
            return 8192 if self.resolved_device.startswith("cuda") else 512
        return self.chunked_prefill_size if self.chunked_prefill_size > 0 else None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    # ---- CLI ---------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model-path", default=None, help="HF model directory; omit for the embedded default")
        p.add_argument("--tokenizer-path", default=None)
        p.add_argument("--served-model-name", default=None)
        p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
        p.add_argument("--skip-tokenizer-init", action="store_true")
        p.add_argument("--context-length", type=int, default=None)
        p.add_argument("--random-seed", type=int, default=0)
        p.add_argument("--device", default="auto")
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        p.add_argument("--mem-fraction-static", type=float, default=None)
        p.add_argument("--max-total-tokens", type=int, default=None)
        p.add_argument("--page-size", type=int, default=None)
        p.add_argument("--max-running-requests", type=int, default=None)
        p.add_argument("--chunked-prefill-size", type=int, default=None)
        p.add_argument("--schedule-policy", default="fcfs", choices=list(SCHEDULE_POLICIES))
        p.add_argument("--disable-radix-cache", action="store_true")
        p.add_argument("--max-prefill-tokens", type=int, default=16384)
        p.add_argument("--attention-backend", default=None, choices=list(ATTENTION_BACKENDS))
        p.add_argument("--disable-cuda-graph", action="store_true")
        p.add_argument("--cuda-graph-max-bs", type=int, default=None)
        p.add_argument("--disable-overlap-schedule", action="store_true")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=DEFAULT_PORT)
        p.add_argument("--api-key", default=None)
        p.add_argument("--log-level", default="info")

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})
