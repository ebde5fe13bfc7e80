"""Server arguments: one frozen dataclass built once from the CLI or from keywords.

Names follow SGLang's `ServerArgs` so a user's flags and `sglang.Engine(...)` keywords carry over.
Derived values are properties; per-process variants are made with `dataclasses.replace`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args, get_origin

DEFAULT_PORT: Final = 30000
DEFAULT_MAX_RUNNING: Final = 256  # --max-running-requests unset
LoadFormat = Literal["auto", "safetensors", "dummy"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
SchedulePolicy = Literal["fcfs", "lpm", "lvf", "wf", "sf"]
PreemptionMode = Literal["recompute", "rotate"]
AttentionBackendName = Literal["torch", "flashinfer"]
OffloadTransport = Literal["local", "torch_dist", "cuda_ipc"]
GrammarBackendName = Literal["xgrammar", "none"]
DisaggregationMode = Literal["prefill", "decode"]
MoERoutingSimulation = Literal["off", "uniform"]
LOAD_FORMATS: Final = get_args(LoadFormat)
SCHEDULE_POLICIES: Final = get_args(SchedulePolicy)
ATTENTION_BACKENDS: Final = get_args(AttentionBackendName)
PREEMPTION_MODES: Final = get_args(PreemptionMode)
ROTATING_POLICIES: Final = ("lvf", "wf", "sf")  # they schedule the rotary queue: need preemption_mode=rotate
DEFAULT_TTFT_SLO_MS: Final = 5000.0  # SuperInfer's SLOs, used by lvf's virtual lag time when none is given
DEFAULT_TPOT_SLO_MS: Final = 100.0
DEFAULT_PROFILE_STEPS: Final = 10
# --expert-distribution-recorder-mode: SGLang's modes, of which sglang_ext records the per-layer totals alone
EXPERT_DISTRIBUTION_MODES: Final = ("stat",)
SGLANG_EXPERT_DISTRIBUTION_MODES: Final = ("stat", "per_pass", "per_token")


def _help(text: str, shown: str | None = None) -> dict[str, str | None]:
    """Field metadata for the CLI: the flag's help and, where the default value alone does not say
    it (None = decided at startup), how `--help` states the default."""
    return {"help": text, "shown": shown}


@dataclass(frozen=True)
class ServerArgs:
    # model
    model_path: str | None = field(default=None, metadata=_help(
        "HF model directory, or preset:NAME (a config-only geometry from sglang_ext/configs, served with "
        "--load-format dummy and the embedded byte-level tokenizer)", "the embedded default model"))
    tokenizer_path: str | None = field(default=None, metadata=_help(
        "tokenizer directory, if not the model's", "the model directory"))
    served_model_name: str | None = field(default=None, metadata=_help(
        "the model name clients use", "the directory name; 'default' for the embedded model"))
    load_format: LoadFormat = field(default="auto", metadata=_help(
        "weights: auto/safetensors, or dummy (deterministic random weights from the config alone)"))
    skip_tokenizer_init: bool = field(default=False, metadata=_help(
        "serve without a tokenizer: requests give input_ids, outputs carry ids and no text"))
    context_length: int | None = field(default=None, metadata=_help(
        "longest prompt + output in tokens", "the model's max_position_embeddings, capped at its sliding_window"))
    random_seed: int = field(default=0, metadata=_help("seed of dummy weights and of unseeded sampling"))
    moe_routing_simulation: MoERoutingSimulation = field(default="off", metadata=_help(
        "MoE benchmarks on dummy weights: 'uniform' replaces the router's choice with k distinct experts drawn "
        "at random per token (what a trained router's load balancing gives, and what the offline bench and the "
        "simulator price); a dummy router's own choice made an MoE's decode steps >= 1.5x cheaper in serving "
        "than that. Needs --load-format dummy"))
    sampling_top_k_window: int = field(default=256, metadata=_help(
        "GPU: batches whose sampled rows all have a top-k of at most this draw from a window of that many "
        "tokens (FlashInfer softmax + radix top-k, one Triton kernel for top-p and the draw); 0: FlashInfer's "
        "rejection kernels always"))
    # device and memory
    device: str = field(default="auto", metadata=_help(
        "cpu, cuda or cuda:N", "auto: cuda if available, else cpu"))
    dtype: DType = field(default="auto", metadata=_help(
        "weights and KV cache dtype", "auto: float32 on CPU; bfloat16 on GPU, float16 if the model says so"))
    mem_fraction_static: float | None = field(default=None, metadata=_help(
        "fraction of device memory for weights + KV pool (of RAM on CPU)",
        "0.85 on GPU; on CPU a fixed 65536-token pool"))
    max_total_tokens: int | None = field(default=None, metadata=_help(
        "KV pool size in tokens; overrides --mem-fraction-static", "from memory on GPU, 65536 on CPU"))
    page_size: int | None = field(default=None, metadata=_help(
        "tokens per KV page; prefix-cache hits are whole pages", "16"))
    # scheduling
    max_running_requests: int | None = field(default=None, metadata=_help(
        "cap on concurrently running requests", "256"))
    chunked_prefill_size: int | None = field(default=None, metadata=_help(
        "max prefill tokens per step; -1 disables chunking", "8192 on GPU, 512 on CPU"))
    schedule_policy: SchedulePolicy = field(default="fcfs", metadata=_help(
        "waiting-queue order: fcfs, lpm (longest prefix match first), or with --preemption-mode rotate: lvf "
        "(largest virtual lag first, SLO-aware), wf (waiting first) or sf (swapped first)"))
    disable_radix_cache: bool = field(default=False, metadata=_help("no prefix sharing between requests"))
    max_prefill_tokens: int = field(default=16384, metadata=_help(
        "max prompt tokens per step when chunking is disabled (--chunked-prefill-size -1)"))
    # preemption by rotation to host memory (docs/architecture.md#rotation)
    preemption_mode: PreemptionMode = field(default="recompute", metadata=_help(
        "what a preempted request's KV becomes: recompute (dropped, recomputed later) or rotate (copied "
        "to a host-memory pool and copied back)"))
    kv_host_size_gb: float | None = field(default=None, metadata=_help(
        "host KV pool for rotated requests (GiB; with --preemption-mode rotate)",
        "with rotate: a share of the host's available memory, logged at start"))
    rotation_budget_mb: float = field(default=256.0, metadata=_help(
        "B_xfer: MiB of KV each scheduling iteration may move per direction for rotations and eager copies"))
    disable_eager_rotation: bool = field(default=False, metadata=_help(
        "do not copy running requests' full KV pages to host memory ahead of a rotation"))
    ttft_slo_ms: float | None = field(default=None, metadata=_help(
        "this worker's time-to-first-token SLO (lvf's S_B); served workers get the cluster file's slo:",
        f"{DEFAULT_TTFT_SLO_MS:g}"))
    tpot_slo_ms: float | None = field(default=None, metadata=_help(
        "this worker's time-per-output-token SLO (lvf's S_F); served workers get the cluster file's slo:",
        f"{DEFAULT_TPOT_SLO_MS:g}"))
    lvf_alpha: float = field(default=3.0, metadata=_help(
        "lvf: weight of decode lag against first-token lag (higher favours running/rotary streams)"))
    lvf_beta_ttft: float = field(default=0.5, metadata=_help(
        "lvf: tolerance of waiting requests, in TTFT SLOs (beta_B)"))
    lvf_beta_tpot: float = field(default=0.5, metadata=_help(
        "lvf: tolerance of rotary requests, in TPOT SLOs (beta_F)"))
    lvf_missed_last: bool = field(default=False, metadata=_help(
        "lvf under KV pressure: requests that have already missed their SLO (TTFT passed with no token yet, or "
        "a stream that can no longer recover its mean TPOT) go behind those that can still meet it, so a late "
        "head of the queue does not hold back rotations for the requests behind it"))
    # kernels
    attention_backend: AttentionBackendName | None = field(default=None, metadata=_help(
        "attention kernels", "flashinfer on GPU when installed and dtype is not float32, else torch"))
    disable_cuda_graph: bool = field(default=False, metadata=_help("run decode without CUDA graphs (GPU)"))
    cuda_graph_max_bs: int | None = field(default=None, metadata=_help(
        "largest decode batch captured as a CUDA graph", "256, capped at --max-running-requests"))
    disable_overlap_schedule: bool = field(default=False, metadata=_help(
        "do not overlap CPU scheduling with GPU work (GPU)"))
    # structured output (regex, json_schema, ebnf, structural_tag, OpenAI response_format)
    grammar_backend: GrammarBackendName = field(default="xgrammar", metadata=_help(
        "grammar library for constrained decoding: xgrammar, or none (constrained requests get a 400)"))
    constrained_json_disable_any_whitespace: bool = field(default=False, metadata=_help(
        "JSON schemas admit no free whitespace: compact JSON with ', ' and ': ' separators"))
    disable_grammar_overlap: bool = field(default=False, metadata=_help(
        "decode batches with constrained rows drain the overlap loop (GPU): the next step's masks are "
        "filled with nothing in flight, not while its forward runs"))
    grammar_compile_workers: int = field(default=2, metadata=_help(
        "threads compiling grammars of any size; one more compiles only small ones (up to 4 KiB), so a "
        "short regex never waits behind large schemas"))
    grammar_compile_queue_size: int = field(default=64, metadata=_help(
        "constraints waiting for a compile thread at most, small and large ones each; past that, one that is "
        "not cached gets a 429"))
    grammar_compile_timeout_s: float = field(default=60.0, metadata=_help(
        "a compilation running longer fails its requests (400); its thread, which cannot be interrupted, "
        "is abandoned (replaced while at most --grammar-compile-workers are) and caches its grammar if it "
        "ends; a constraint that waited this long for a compile thread gets a 429"))
    grammar_max_bytes: int = field(default=65536, metadata=_help(
        "longest regex / json_schema / ebnf / structural_tag in bytes: a longer one is a 400 before "
        "anything compiles (0: no limit)"))
    grammar_cache_size: int = field(default=512, metadata=_help(
        "compiled grammars kept per worker, the least recently used dropped first (0: none)"))
    # OpenAI function calling and reasoning (docs/api.md#function-calling)
    tool_call_parser: str | None = field(default=None, metadata=_help(
        "how this model writes tool calls, for OpenAI `tools`: qwen25 (also qwen, qwen3, hermes), llama3 or "
        "mistral; without one, chat requests with tools get a 400", "qwen25 for the embedded default model "
        "and presets, else none"))
    reasoning_parser: str | None = field(default=None, metadata=_help(
        "split `<think>` reasoning into reasoning_content: qwen3 (a block at the output's start), "
        "deepseek-r1 or qwen3-thinking (the template opened the block)", "none"))
    # remote attention (docs/remote_attention.md)
    offload_ratio: float = field(default=0.0, metadata=_help(
        "share of decoding requests whose attention and KV run on an executor (0: none)"))
    offload_executor: str | None = field(default=None, metadata=_help(
        "an in-process executor for this worker's offloaded requests: 'local' (same device) or a device "
        "such as cuda:1; served clusters pair workers with the cluster file's offload: entries instead", "none"))
    offload_policy: str = field(default="fixed", metadata=_help(
        "who sets an in-process executor's share: fixed (offload_ratio, always) or adaptive (the router's "
        "adaptive controller run by this worker on its own measurements, starting at offload_ratio; "
        "docs/configuration.md); served pairings take the cluster file's offload: policy instead"))
    offload_adaptive: str | None = field(default=None, metadata=_help(
        "offload_policy adaptive's settings as JSON, the keys of a cluster file's adaptive: (step_down, "
        "step_up, slack, interval_s, min_context_tokens)", "their defaults"))
    executor_mem_gb: float = field(default=0.0, metadata=_help(
        "memory this worker offers other models' offloaded KV (GiB; 0: hosts nothing). For "
        "--offload-executor, the executor's size (0: as large as this worker's own KV pool)"))
    executor_reserved_sms: int = field(default=0, metadata=_help(
        "SMs of this worker's GPU kept for the attention executor it hosts: its own model runs in a CUDA "
        "green context of the other SMs (Adrenaline's partition; needs executor_mem_gb or "
        "offload_executor, a GPU and FlashInfer; 0: no partition). Not yet measured in serving"))
    executor_max_sms: int = field(default=0, metadata=_help(
        "at most this many SMs for the attention executor this worker hosts: its GPU-signalled programs "
        "(cuda_ipc pairings, or --offload-executor cuda:N) run in a CUDA green context of that many SMs "
        "(rounded up to 8 on Hopper), which bounds what hosting costs the GPU's own model (needs "
        "executor_mem_gb or offload_executor, a GPU and FlashInfer; 0: uncapped; not with "
        "executor_reserved_sms)"))
    offload_transport: OffloadTransport | None = field(default=None, metadata=_help(
        "data plane to the executor: local, torch_dist (gloo on CPU, NCCL on GPU) or cuda_ipc. Unset, a "
        "served pairing between GPUs of one node uses cuda_ipc (torch_dist where the executor's host finds no "
        "peer path); torch_dist turns that automatic choice off",
        "chosen from the placement"))
    disable_ipc_staged_loads: bool = field(default=False, metadata=_help(
        "the executors this worker hosts offer cuda_ipc senders no KV stage: offloaded requests' KV then "
        "goes over the pairing's gloo channel (through host memory) instead of GPU to GPU"))
    # prefill/decode disaggregation (docs/architecture.md#prefilldecode-disaggregation)
    disaggregation_mode: DisaggregationMode | None = field(default=None, metadata=_help(
        "this worker's part in prefill/decode disaggregation behind a router: prefill (prompt and first "
        "token, then its KV goes to a decode worker) or decode (continues from a prefill worker's KV)",
        "null: serves whole requests"))
    disable_pd_kv_ipc: bool = field(default=False, metadata=_help(
        "a decode worker takes KV from a prefill worker on a GPU of the same node over NCCL instead of "
        "CUDA IPC peer copies through a stage on its GPU"))
    # diagnostics: a worker's step profile in its log, a torch.profiler window over its steps
    step_log_interval_s: float = field(default=0.0, metadata=_help(
        "seconds between a worker's step profile lines in its log: steps/s, mean step time, running, "
        "remote and waiting requests, rows per forward, tokens/s, time blocked on the executor (0: off, "
        "nothing is measured)"))
    profile_dir: str | None = field(default=None, metadata=_help(
        "run torch.profiler over a window of each worker's steps, then write <worker id>.txt (top ops by "
        "self device and CPU time) and <worker id>.trace.json (a Chrome trace) into this directory", "off"))
    profile_start_step: int = field(default=0, metadata=_help(
        "with --profile-dir: the window's first step (steps with work, counted from the worker's start)"))
    profile_num_steps: int = field(default=DEFAULT_PROFILE_STEPS, metadata=_help(
        "with --profile-dir: the window's length in steps"))
    expert_distribution_recorder_mode: str | None = field(default=None, metadata=_help(
        "MoE models: 'stat' counts, per MoE layer and expert, the tokens the router sends there (one small "
        "scatter-add per layer and forward, inside the decode CUDA graphs too); POST "
        "/start_expert_distribution_record, /stop_expert_distribution_record and /dump_expert_distribution_record "
        "read it. SGLang's per_pass and per_token modes are not implemented", "off: nothing is counted"))
    # serving
    host: str = field(default="127.0.0.1", metadata=_help("HTTP bind address"))
    port: int = field(default=DEFAULT_PORT, metadata=_help("HTTP port"))
    api_key: str | None = field(default=None, metadata=_help(
        "require 'Authorization: Bearer KEY' on every route but /health", "none"))
    log_level: str = field(default="info", metadata=_help("debug, info, warning or error"))

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
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.moe_routing_simulation not in get_args(MoERoutingSimulation):
            raise ValueError(f"moe_routing_simulation must be one of {get_args(MoERoutingSimulation)}, "
                             f"got {self.moe_routing_simulation!r}")
        if self.moe_routing_simulation != "off" and self.load_format != "dummy":
            raise ValueError("moe_routing_simulation replaces the router's choice, which makes a real model's "
                             "outputs meaningless: it needs --load-format dummy")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0:
            raise ValueError("chunked_prefill_size must be positive, or negative/None to disable")
        if not 0.0 <= self.offload_ratio <= 1.0:
            raise ValueError(f"offload_ratio must be in [0, 1], got {self.offload_ratio}")
        if self.executor_mem_gb < 0:
            raise ValueError(f"executor_mem_gb must be >= 0, got {self.executor_mem_gb}")
        if self.executor_reserved_sms < 0:
            raise ValueError(f"executor_reserved_sms must be >= 0, got {self.executor_reserved_sms}")
        if self.executor_max_sms < 0:
            raise ValueError(f"executor_max_sms must be >= 0, got {self.executor_max_sms}")
        if self.executor_max_sms and self.executor_reserved_sms:
            raise ValueError("executor_max_sms and executor_reserved_sms pull opposite ways (a cap on the "
                             "executor's SMs, SMs kept for it): set one")
        if self.offload_executor is not None and not (
                self.offload_executor in ("local", "cpu") or self.offload_executor.startswith("cuda")):
            raise ValueError(f"offload_executor must be 'local' or a device such as cuda:1, got "
                             f"{self.offload_executor!r}")
        self._check_rotation()
        self._check_diagnostics()
        self._check_grammar()
        self._check_sampling()
        self._check_parsers()
        if self.disaggregation_mode is not None and self.disaggregation_mode not in get_args(DisaggregationMode):
            raise ValueError(f"disaggregation_mode must be null, 'prefill' or 'decode', "
                             f"got {self.disaggregation_mode!r}")
        if self.offload_executor is not None and self.offload_ratio == 0.0:
            raise ValueError("offload_executor is set but offload_ratio is 0: give the share to offload")
        self._check_offload_policy()

    def _check_offload_policy(self) -> None:
        if self.offload_policy not in ("fixed", "adaptive"):
            raise ValueError(f"offload_policy must be 'fixed' or 'adaptive', got {self.offload_policy!r} (adrenaline "
                             "is for served pairings: a cluster file's offload: entry)")
        if self.offload_policy != "fixed" and self.offload_executor is None:
            raise ValueError("offload_policy is for an in-process executor (offload_executor); served pairings "
                             "take the cluster file's offload: policy")
        if self.offload_adaptive is not None:
            if self.offload_policy != "adaptive":
                raise ValueError("offload_adaptive is set but offload_policy is not 'adaptive'")
            try:
                ok = isinstance(json.loads(self.offload_adaptive), dict)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"offload_adaptive must be a JSON object, got {self.offload_adaptive!r}")

    def _check_rotation(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        rotate = self.preemption_mode == "rotate"
        if self.schedule_policy in ROTATING_POLICIES and not rotate:
            raise ValueError(f"schedule_policy {self.schedule_policy!r} schedules rotated requests: "
                             "set preemption_mode to 'rotate'")
        if self.kv_host_size_gb is not None:
            if not rotate:
                raise ValueError("kv_host_size_gb is set but preemption_mode is 'recompute': the host pool "
                                 "is used only with preemption_mode 'rotate'")
            if not self.kv_host_size_gb > 0:
                raise ValueError(f"kv_host_size_gb must be > 0, got {self.kv_host_size_gb}")
        if not self.rotation_budget_mb > 0:
            raise ValueError(f"rotation_budget_mb must be > 0, got {self.rotation_budget_mb}")
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and v != float("inf")):
                raise ValueError(f"{name} must be a positive number of milliseconds, got {v}")
        if not (self.lvf_alpha > 0 and self.lvf_alpha != float("inf")):
            raise ValueError(f"lvf_alpha must be > 0, got {self.lvf_alpha}")
        for name in ("lvf_beta_ttft", "lvf_beta_tpot"):
            v = getattr(self, name)
            if not 0 <= v < float("inf"):
                raise ValueError(f"{name} must be >= 0, got {v}")

    def _check_parsers(self) -> None:
        from sglang_ext.parsers import check_reasoning_parser, tool_parser_name

        if self.tool_call_parser is not None:
            tool_parser_name(self.tool_call_parser)
        if self.reasoning_parser is not None:
            check_reasoning_parser(self.reasoning_parser)

    def _check_sampling(self) -> None:
        if not 0 <= self.sampling_top_k_window <= 1024:  # sglang_ext/sampling/window_pick.py MAX_WINDOW
            raise ValueError(f"sampling_top_k_window must be in [0, 1024] (0: off), got {self.sampling_top_k_window}")

    def _check_grammar(self) -> None:
        for name in ("grammar_compile_workers", "grammar_compile_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.grammar_compile_timeout_s < float("inf"):
            raise ValueError(f"grammar_compile_timeout_s must be a positive number of seconds, "
                             f"got {self.grammar_compile_timeout_s}")
        for name in ("grammar_max_bytes", "grammar_cache_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: {'no limit' if name == 'grammar_max_bytes' else 'none'}), "
                                 f"got {getattr(self, name)}")

    def _check_diagnostics(self) -> None:
        mode = self.expert_distribution_recorder_mode
        if mode is not None and mode not in EXPERT_DISTRIBUTION_MODES:
            sglang = mode in SGLANG_EXPERT_DISTRIBUTION_MODES
            other = " (an SGLang mode that sglang_ext does not implement)" if sglang else ""
            raise ValueError(f"expert_distribution_recorder_mode {mode!r} is not supported{other}: the supported mode "
                             f"is {', '.join(map(repr, EXPERT_DISTRIBUTION_MODES))} (or none, to count nothing)")
        if not 0.0 <= self.step_log_interval_s < float("inf"):
            raise ValueError(f"step_log_interval_s must be >= 0 seconds (0: off), got {self.step_log_interval_s}")
        if self.profile_dir is None:
            if (self.profile_start_step, self.profile_num_steps) != (0, DEFAULT_PROFILE_STEPS):
                raise ValueError("profile_start_step / profile_num_steps are set but profile_dir is not: "
                                 "give the directory to profile into")
            return
        if not self.profile_dir:
            raise ValueError("profile_dir must name a directory")
        if self.profile_start_step < 0:
            raise ValueError(f"profile_start_step must be >= 0, got {self.profile_start_step}")
        if self.profile_num_steps < 1:
            raise ValueError(f"profile_num_steps must be >= 1, got {self.profile_num_steps}")

    # ---- derived values -------------------------------------------------------------------
    @property
    def resolved_tool_call_parser(self) -> str:
        """The tool-call parser's canonical name ("": none). The embedded model (and the presets, which
        use its tokenizer) writes calls the Qwen 2.5 way (its chat template says so)."""
        from sglang_ext.parsers import tool_parser_name

        if self.tool_call_parser is not None:
            return tool_parser_name(self.tool_call_parser)
        embedded = self.tokenizer_path is None and (self.model_path is None
                                                    or self.model_path.startswith("preset:"))  # PRESET_PREFIX
        return "qwen25" if embedded else ""

    @property
    def resolved_ttft_slo_s(self) -> float:
        return (self.ttft_slo_ms if self.ttft_slo_ms is not None else DEFAULT_TTFT_SLO_MS) / 1e3

    @property
    def resolved_tpot_slo_s(self) -> float:
        return (self.tpot_slo_ms if self.tpot_slo_ms is not None else DEFAULT_TPOT_SLO_MS) / 1e3

    @property
    def rotation_budget_bytes(self) -> int:
        return int(self.rotation_budget_mb * (1 << 20))

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

    @property
    def prefill_budget(self) -> int:
        """Prefill tokens one step may carry: the chunk, or with chunking off the whole prefill budget."""
        return self.resolved_chunked_prefill_size or self.max_prefill_tokens

    @property
    def resolved_max_running_requests(self) -> int:
        return self.max_running_requests or DEFAULT_MAX_RUNNING

    @property
    def max_forward_tokens(self) -> int:
        """The most tokens one forward can carry: a prefill budget plus every running request decoding
        alongside (the scheduler's EXTEND batch)."""
        return self.prefill_budget + self.resolved_max_running_requests

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    # ---- CLI: derived from the fields, so a new argument is a flag with help by construction ----
    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind, choices = _cli_type(hints[f.name])
            shown = f.metadata["shown"]
            if kind is bool:
                if f.default is not False:
                    raise TypeError(f"{f.name}: a bool flag must default to False (store_true)")
                text = f"{f.metadata['help']} (default: off)"
                p.add_argument(flag, action="store_true", help=text.replace("%", "%%"))
                continue
            if f.default is None and shown is None:
                raise TypeError(f"{f.name}: a field defaulting to None needs `shown` (what None means)")
            text = f"{f.metadata['help']} (default: {shown if shown is not None else f.default})"
            p.add_argument(flag, type=kind, default=f.default, choices=choices, help=text.replace("%", "%%"))

    @classmethod
    def flags_to_kwargs(cls, flags: list[str]) -> dict[str, Any]:
        """Keywords of launcher flags (`["--lvf-missed-last", "--chunked-prefill-size=4096"]`), only those the
        flags set to something other than the default: for tools that pass a run's launcher flags to an
        in-process engine or scheduler. An unknown flag exits with argparse's message."""
        p = argparse.ArgumentParser(prog="launcher flags", add_help=False)
        cls.add_cli_args(p)
        defaults = vars(p.parse_args([]))
        return {k: v for k, v in vars(p.parse_args(flags)).items() if v != defaults[k]}

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def _cli_type(t: Any) -> tuple[type, list[Any] | None]:
    """(argparse type, choices) of a field type: Optional is unwrapped, a Literal gives choices."""
    if get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in get_args(t) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported CLI type {t!r}")
        t = args[0]
    if get_origin(t) is Literal:
        choices = list(get_args(t))
        return type(choices[0]), choices
    if t in (bool, int, float, str):
        return t, None
    raise TypeError(f"unsupported CLI type {t!r}")
