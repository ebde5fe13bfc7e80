"""Builds a worker's remote-attention pieces from its server arguments."""

from __future__ import annotations

import logging

import torch

from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.offload.executor import AttentionExecutor, GuestSpec
from sglang_ext.offload.partition import ForeignKVPartition
from sglang_ext.offload.remote import LocalRemote, RemoteAttention
from sglang_ext.offload.sender import RemoteSender
from sglang_ext.server_args import ServerArgs

logger = logging.getLogger(__name__)
GiB = 1 << 30


def guest_spec(runner: ModelRunner) -> GuestSpec:
    cfg = runner.cfg
    return GuestSpec(runner.pool.geometry, cfg.num_heads, cfg.head_dim, cfg.head_dim**-0.5)


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID, the same in every process whatever its CUDA_VISIBLE_DEVICES ("" on a CPU)."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def executor_backend(device: torch.device, args: ServerArgs) -> str:
    """The executor computes with the engine's own kernels: FlashInfer on a GPU where the worker
    uses it, the exact torch backend elsewhere."""
    return args.resolved_attention_backend if device.type == "cuda" else "torch"


def local_sender(args: ServerArgs, runner: ModelRunner, worker_id: str) -> RemoteSender | None:
    """`--offload-executor local|cuda:N`: an executor inside this process (tests, demos, one
    process driving two GPUs)."""
    if args.offload_executor is None or args.offload_ratio <= 0:
        return None
    where = args.offload_executor
    device = runner.device if where in ("local", str(runner.device)) else torch.device(where)
    budget = int(args.executor_mem_gb * GiB) if args.executor_mem_gb > 0 else runner.pool.total_bytes
    if args.executor_max_sms and device.type == "cuda" and device != runner.device:
        from sglang_ext.engine import sm_partition

        sm_partition.cap_executor(device, args.executor_max_sms)  # the runner capped its own device
    executor = AttentionExecutor(ForeignKVPartition(budget, device), executor_backend(device, args))
    # In one process: the GPU-signalled peer exchange (`cuda_ipc`) when the executor is on another GPU
    # (verified on two H200s: same greedy tokens, no host on the per-layer path), torch copies otherwise.
    other_gpu = device.type == "cuda" and device != runner.device
    transport = args.offload_transport or ("cuda_ipc" if other_gpu else "local")
    remote: RemoteAttention
    if transport == "cuda_ipc":
        if not other_gpu:
            raise ValueError("offload_transport cuda_ipc in one process needs the executor on another GPU "
                             "(--offload-executor cuda:N)")
        from sglang_ext.offload.peer import PeerRemote

        remote = PeerRemote(executor, worker_id, guest_spec(runner), runner.device, runner.cfg.num_heads,
                            max_rows=max(args.resolved_max_running_requests, 1), executor_id=f"{worker_id}/{device}")
    elif transport == "local":
        remote = LocalRemote(executor, guest=worker_id, spec=guest_spec(runner), executor_id=f"{worker_id}/local")
    else:
        raise ValueError(f"offload_transport {transport!r} is for served pairings (cluster file offload:), "
                         "not for an in-process executor")
    runner.set_remote(remote)
    logger.info("remote attention: %.0f%% of decoding requests on an in-process executor on %s (%.2f GiB, %s)",
                100 * args.offload_ratio, device, budget / GiB, transport)
    return RemoteSender(remote, args.offload_ratio, runner.pool)
