"""Control messages between clients (router, offline Engine) and workers.

Every message is a tagged msgspec Struct encoded with msgpack; tensors (for the data plane of
later issues) travel as extra ZeroMQ frames described in the header. Decoding is strict: an
unknown tag, a missing field or a wrong type is rejected, never guessed.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from sglang_ext.sampling.params import SamplingParams


class Disagg(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request's part in prefill/decode disaggregation: the prefill worker computes the prompt and
    the first token and sends the prompt's KV over `pairing` to the decode worker, which takes the
    same request (the same rid) and continues. `room` names the transfer on the pair's wire."""

    role: str  # "prefill" | "decode": what the receiving worker does with it
    pairing: str  # the router's id of the (prefill, decode) pair
    room: int
    # decode, resumed: the prefill worker's KV will not come (it died, or the pair broke, after the
    # first token went out): continue after this first token, recomputing the prompt's KV here
    first_token: int = -1
    # Adrenaline placement (both legs): the prefill worker keeps the prompt's KV in its own executor,
    # under the decode worker's offload pairing `executor_pairing` as request `handle`, instead of
    # sending it; the decode worker runs it as a remote row there. 0: the KV is sent (plain PD).
    executor_pairing: str = ""
    handle: int = 0


class GenerateReq(msgspec.Struct, tag="generate", kw_only=True):
    rid: str
    input_ids: list[int] | None = None
    text: str | None = None
    messages: list[dict[str, Any]] | None = None  # chat: the worker applies the model's template
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI tools, rendered by the template with the messages
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    disagg: Disagg | None = None  # set by the router for a disaggregated request


class AbortReq(msgspec.Struct, tag="abort", kw_only=True):
    rid: str
    message: str = "aborted by the client"


class FlushCacheReq(msgspec.Struct, tag="flush_cache", kw_only=True):
    rid: str = ""


class TokenizeReq(msgspec.Struct, tag="tokenize", kw_only=True):
    """Ask the worker to tokenize (or apply the chat template) without generating. Answered with a
    ReplyOut whose data has `input_ids`, or an ErrorOut (400) for what cannot be tokenized."""

    rid: str
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # text only: the tokenizer's BOS and the like (SGLang's /tokenize)


class DetokenizeReq(msgspec.Struct, tag="detokenize", kw_only=True):
    """Token ids to text (SGLang's /detokenize). ReplyOut data `text`; ErrorOut 400 for an id outside
    the tokenizer's vocabulary."""

    rid: str
    tokens: list[int]
    skip_special_tokens: bool = True


class ProfileReq(msgspec.Struct, tag="profile", kw_only=True, forbid_unknown_fields=True):
    """Start or stop the torch profiler over the worker's steps (/start_profile, /stop_profile).
    `start`: into `output_dir` ("": $SGLANG_TORCH_PROFILER_DIR, else /tmp); with `num_steps` it stops by
    itself after that many steps with work; `activities` among CPU / GPU (empty: GPU on a GPU, and CPU).
    Answered with a ReplyOut: `message`, and `files` written (stop, or a start whose window ended); or
    ok=False and `error` (a stop without a start, a start while profiling, ...)."""

    rid: str
    action: Literal["start", "stop"]
    output_dir: str = ""
    num_steps: int | None = None
    activities: list[str] = msgspec.field(default_factory=list)


class ExpertDistributionReq(msgspec.Struct, tag="expert_distribution", kw_only=True, forbid_unknown_fields=True):
    """The MoE expert distribution recorder (/start_expert_distribution_record, /stop_..., /dump_...):
    `start` a record, `stop` it, `dump` it to files. `output_dir` ("": the one given before, else
    $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else /tmp) is where dumps go from now on. Answered with a
    ReplyOut: `message` and `files` written (dump); or ok=False, `error` and `status` 400 (a dense model, a
    server without --expert-distribution-recorder-mode, a stop without a start, an unwritable output_dir)."""

    rid: str
    action: Literal["start", "stop", "dump"]
    output_dir: str = ""


class UpdateWeightsReq(msgspec.Struct, tag="update_weights", kw_only=True, forbid_unknown_fields=True):
    """Reload the model's weights from `model_path` in place (/update_weights_from_disk). The worker
    drains first: requests it holds finish on the old weights while new ones wait; then it loads, drops
    its prefix cache (KV of the old weights) and lets the waiting ones run on the new weights. A
    checkpoint that cannot be loaded (no such path, another architecture or shapes) leaves the old
    weights in place. Answered with a ReplyOut: ok, and `message`."""

    rid: str
    model_path: str
    load_format: str = ""  # "" / auto / safetensors: the checkpoint's safetensors; dummy: random weights


class ShutdownReq(msgspec.Struct, tag="shutdown", kw_only=True):
    pass


class HelloReq(msgspec.Struct, tag="hello_req", kw_only=True):
    """The router asks a worker it does not know (the router restarted under it) to say hello again."""


class TokenOut(msgspec.Struct, kw_only=True):
    """New output of one request since its previous TokenOut (deltas), plus running totals."""

    rid: str
    text_delta: str
    token_ids: list[int]
    finished: bool
    meta_info: dict[str, Any]


class BatchOut(msgspec.Struct, tag="batch_out", kw_only=True):
    outs: list[TokenOut]


class ErrorOut(msgspec.Struct, tag="error", kw_only=True):
    rid: str
    message: str
    status: int = 400


class ReplyOut(msgspec.Struct, tag="reply", kw_only=True):
    """Answer to a non-generate request (flush_cache, tokenize)."""

    rid: str
    ok: bool
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class WorkerInfo(msgspec.Struct, kw_only=True):
    worker_id: str
    model_name: str
    model_path: str
    architecture: str
    context_length: int
    vocab_size: int
    max_total_tokens: int
    page_size: int
    device: str
    dtype: str
    attention_backend: str
    has_tokenizer: bool
    chat_template: bool
    pid: int
    max_token_chars: int = 0  # longest token's text in characters (0: unknown); bounds tokens by characters
    # Remote attention: the attention shape an executor needs to host this worker's requests (its
    # GuestSpec; 0 / "" from workers that predate it), and the memory it offers other models' KV.
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    num_q_heads: int = 0
    attn_scale: float = 0.0
    kv_dtype: str = ""
    executor_mem_bytes: int = 0  # 0: hosts no executor
    # Where it runs, for the router's choice of a pairing's transport (transport/choice.py): the
    # machine's host name, its GPU's UUID ("" on a CPU), and the transport its arguments force ("": any).
    hostname: str = ""
    gpu_uuid: str = ""
    offload_transport: str = ""
    disaggregation_mode: str = ""  # "" | prefill | decode (its server argument)
    # How the router reads this model's chat output (server arguments; "": none): the OpenAI layer parses
    # tool calls and reasoning, so it learns them here.
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    grammar_backend: str = ""  # "none": constrained requests fail there (tool_choice auto then runs free)


class WorkerHello(msgspec.Struct, tag="hello", kw_only=True):
    info: WorkerInfo


OffloadState = Literal["", "active", "draining", "lost", "failed"]


# The report's parts below take unknown fields, as LoadReport itself does: a newer worker may report more.
class OffloadSender(msgspec.Struct, kw_only=True):
    """Remote attention, as a sender: requests on the executor now; cumulative bytes and seconds waited
    over this process's life (the router makes counters of them); the pairing in force."""

    reqs: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    wait_s: float = 0.0
    staged_loads: int = 0  # KV loads sent GPU to GPU through the host's stage (cuda_ipc)
    executor: str = ""  # the executor's worker id ("" while none)
    pairing: str = ""  # the router's id of the directive in force
    state: OffloadState = ""  # "": no pairing (or one drained)
    error: str = ""  # why, in state failed
    ratio: float = 0.0  # the share cap in force (OffloadDirective / OffloadRatio)
    bound: float = 0.0  # Adrenaline's OB in force (policy adrenaline; 0 otherwise)

    def state_text(self) -> str:
        """The state in one string, the reason after a failure: `failed: why`."""
        return f"{self.state}: {self.error}" if self.error else self.state


class ExecutorKV(msgspec.Struct, kw_only=True):
    """Remote attention, as a host: KV tokens held per guest model; per pairing id, tokens held and tokens
    it could still get (free slabs are shared by every guest)."""

    used_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    pairing_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    free_tokens: dict[str, int] = msgspec.field(default_factory=dict)


class RotationStats(msgspec.Struct, kw_only=True):
    """KV rotation (preemption_mode=rotate): rotary requests and host-pool bytes now; cumulative rotations,
    bytes and unhidden-transfer iterations over this process's life."""

    rotary_reqs: int = 0
    host_used_bytes: int = 0
    host_total_bytes: int = 0
    rotations_out: int = 0
    rotations_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    unhidden_iterations: int = 0


class KVTransferStats(msgspec.Struct, kw_only=True):
    """Prefill/decode disaggregation, cumulative: requests' KV sent (a prefill worker) and received (a
    decode worker), and their bytes."""

    transfers_out: int = 0
    transfers_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0


class Latency(msgspec.Struct, kw_only=True):
    """The latency the router's planners steer by, over the last few seconds."""

    # P99 of finished requests' TPOT (0 with no samples) and how many requests it covers
    tpot_p99_ms: float = 0.0
    tpot_samples: int = 0
    # ... and of the first tokens it computed (from the request's arrival here): what the planner steers
    # by when this worker is a prefill worker hosting an executor (Adrenaline)
    ttft_p99_ms: float = 0.0
    ttft_samples: int = 0
    # Mean wall time of its steps that decoded a running request's next token, and how many: the token
    # interval its running requests see, which a larger offload share (a larger batch) lengthens; what
    # the adaptive planner keeps within the sender's TPOT SLO
    decode_step_ms: float = 0.0
    decode_steps: int = 0


class LoadReport(msgspec.Struct, tag="load", kw_only=True):
    """Periodic load report; doubles as the worker's heartbeat. One part per mechanism beside the base
    figures: a part is None where the mechanism has nothing to report (every figure zero or empty)."""

    worker_id: str
    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_total_tokens: int
    kv_cached_tokens: int
    num_preemptions: int
    step_time_ms: float
    timestamp: float
    # mean context (prompt + output tokens) of its decoding requests now, offloaded ones included; 0 with
    # none (or from a worker of an older version): what `adaptive` compares with min_context_tokens
    decode_context_tokens: float = 0.0
    latency: Latency = msgspec.field(default_factory=Latency)
    offload: OffloadSender | None = None
    executor: ExecutorKV | None = None
    rotation: RotationStats | None = None
    disagg: KVTransferStats | None = None

    def flat(self) -> dict[str, Any]:
        """The report as one flat dict, under the names /get_server_info has always shown (a user
        contract): each part's figures with their mechanism's prefix, defaults for an absent part."""
        base = {k: v for k, v in msgspec.to_builtins(self).items() if k not in _PARTS}
        o, x = self.offload or OffloadSender(), self.executor or ExecutorKV()
        lat, r, d = self.latency, self.rotation or RotationStats(), self.disagg or KVTransferStats()
        return {
            **base,
            "offloaded_reqs": o.reqs, "offload_bytes_out": o.bytes_out, "offload_bytes_in": o.bytes_in,
            "offload_wait_s": o.wait_s, "offload_staged_loads": o.staged_loads, "offload_executor": o.executor,
            "offload_pairing": o.pairing, "offload_state": o.state_text(), "offload_ratio": o.ratio,
            "offload_bound": o.bound,
            "executor_kv_used_tokens": dict(x.used_tokens), "executor_kv_pairing_tokens": dict(x.pairing_tokens),
            "executor_kv_free_tokens": dict(x.free_tokens),
            "tpot_p99_ms": lat.tpot_p99_ms, "tpot_samples": lat.tpot_samples, "ttft_p99_ms": lat.ttft_p99_ms,
            "ttft_samples": lat.ttft_samples, "decode_step_ms": lat.decode_step_ms, "decode_steps": lat.decode_steps,
            "rotary_reqs": r.rotary_reqs, "kv_host_used_bytes": r.host_used_bytes,
            "kv_host_total_bytes": r.host_total_bytes, "kv_rotations_out": r.rotations_out,
            "kv_rotations_in": r.rotations_in, "kv_rotation_bytes_out": r.bytes_out,
            "kv_rotation_bytes_in": r.bytes_in, "kv_rotation_unhidden_iterations": r.unhidden_iterations,
            "kv_transfers_out": d.transfers_out, "kv_transfers_in": d.transfers_in,
            "kv_transfer_bytes_out": d.bytes_out, "kv_transfer_bytes_in": d.bytes_in,
        }


_PARTS = frozenset({"latency", "offload", "executor", "rotation", "disagg"})


class ExecutorOpen(msgspec.Struct, tag="executor_open", kw_only=True, forbid_unknown_fields=True):
    """Router -> hosting worker: serve an executor for `guest` (a sender worker) over a new pair.
    Answered with a ReplyOut whose data has `store` (HOST:PORT of the pair's rendezvous), `backend`
    (gloo | nccl) and `transport` (the one served: `fallback` when `transport` cannot work here), or
    ok=False and `error`."""

    rid: str
    guest: str  # the sender's worker id
    guest_model: str
    pairing: str  # the router's id of this pairing; a guest paired again gets a new one
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str  # torch dtype name of the guest's KV, e.g. "bfloat16"
    num_q_heads: int
    scale: float
    guest_device: str
    transport: str = "torch_dist"
    fallback: str = ""  # served instead when `transport` cannot work on this host ("": refuse)
    guest_gpu: str = ""  # the sender GPU's UUID (cuda_ipc: which local GPU it is, and is there a peer path)
    timeout_s: float = 5.0


class OffloadDirective(msgspec.Struct, tag="offload", kw_only=True, forbid_unknown_fields=True):
    """Router -> sender: offload `ratio` of the decoding requests to `executor` (its pair's
    rendezvous at `store`), or, with `detach` (or ratio 0), take no new ones: requests already
    there finish there, or are recomputed locally if the executor is gone. Policy `adrenaline`:
    a request goes out only when it also meets Adrenaline's conditions C1/C2 under the bound
    `bound` (OB: offloaded over local KV tokens); `ratio` then caps the share."""

    pairing: str
    executor: str = ""
    store: str = ""
    backend: str = "gloo"
    ratio: float = 0.0
    policy: str = "fixed"  # fixed | adrenaline | adaptive
    bound: float = 0.0
    transport: str = "torch_dist"
    timeout_s: float = 5.0
    detach: bool = False
    # "" (WEAVER): the sender chooses which decoding requests go out. "prefill" (Adrenaline placement):
    # the executor is a prefill worker of the sender's own model, and only requests the router placed
    # there at prefill (Disagg.handle) run remotely; the sender moves none of its own.
    placement: str = ""


class OffloadRatio(msgspec.Struct, tag="offload_ratio", kw_only=True, forbid_unknown_fields=True):
    """Router -> sender: a planner's new decision for the pairing in force, applied live (no new
    pairing): new requests follow `ratio` (0: none go out) and `bound`; requests already on the
    executor stay there. Ignored unless `pairing` is the one in force."""

    pairing: str
    ratio: float
    bound: float = 0.0


class KVPairOpen(msgspec.Struct, tag="kv_pair_open", kw_only=True, forbid_unknown_fields=True):
    """Router -> decode worker: receive KV from prefill worker `peer` over a new pair. Answered with a
    ReplyOut whose data has `store` (HOST:PORT of the pair's rendezvous) and `backend`, or ok=False
    and `error`."""

    rid: str
    pairing: str
    peer: str  # the prefill worker's id
    peer_device: str
    timeout_s: float = 30.0
    # where the prefill worker runs (its hello's): the pair uses CUDA IPC peer copies when both are
    # GPUs of one node in two processes
    peer_host: str = ""
    peer_gpu: str = ""
    peer_pid: int = 0


class KVPairConnect(msgspec.Struct, tag="kv_pair_connect", kw_only=True, forbid_unknown_fields=True):
    """Router -> prefill worker: send KV to decode worker `peer` over the pair at `store`; replaces
    any earlier pair to that peer. `close`: drop the pair (its peer is gone)."""

    pairing: str
    peer: str
    store: str = ""
    backend: str = "gloo"
    timeout_s: float = 30.0
    close: bool = False


class KVPairClose(msgspec.Struct, tag="kv_pair_close", kw_only=True, forbid_unknown_fields=True):
    """Router -> decode worker: the prefill side of `pairing` is down (it may be hung rather than
    dead, with its sockets open): requests still waiting for KV from it fail now (a 503)."""

    pairing: str


ToWorker = (GenerateReq | AbortReq | FlushCacheReq | TokenizeReq | DetokenizeReq | ProfileReq | UpdateWeightsReq
            | ExpertDistributionReq | ShutdownReq | HelloReq | ExecutorOpen | OffloadDirective | OffloadRatio
            | KVPairOpen | KVPairConnect | KVPairClose)
FromWorker = BatchOut | ErrorOut | ReplyOut | WorkerHello | LoadReport
