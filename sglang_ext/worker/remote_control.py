"""A worker's part in served remote attention, driven by the router's messages.

    as a host (executor_mem_gb > 0):  ExecutorOpen -> an ExecutorService thread for that sender
    as a sender:                      OffloadDirective -> DistRemote (torch_dist) or IpcRemote (cuda_ipc)
                                      + RemoteSender installed between steps; detach (or ratio 0) -> the
                                      pair closes once the requests there have finished
                                      OffloadRatio -> a new ratio (and Adrenaline bound) for new requests

Everything here runs on the worker's forward thread (through its inbox), never during a step; the
load report (another thread) only reads numbers.
"""

from __future__ import annotations

import logging
import socket
from typing import Final, cast

import msgspec

from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.messages import ExecutorOpen, OffloadDirective, OffloadRatio, ReplyOut, WorkerInfo
from sglang_ext.messages.io import ExecutorKV, OffloadSender, OffloadState
from sglang_ext.offload.dist import DistRemote
from sglang_ext.offload.executor import AttentionExecutor
from sglang_ext.offload.host import ExecutorHost
from sglang_ext.offload.partition import ForeignKVPartition
from sglang_ext.offload.remote import ExecutorLost, LocalRemote, RemoteAttention
from sglang_ext.offload.sender import RemoteSender
from sglang_ext.offload.setup import GiB, executor_backend, gpu_uuid, guest_spec
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler
from sglang_ext.server_args import ServerArgs
from sglang_ext.transport.choice import check_served
from sglang_ext.worker.stats import present

logger = logging.getLogger(__name__)
POLICIES: Final = ("fixed", "adrenaline", "adaptive")


class RemoteAttentionControl:
    def __init__(self, args: ServerArgs, runner: ModelRunner, worker_id: str, model_name: str) -> None:
        self.args = args
        self.runner = runner
        self.worker_id = worker_id
        self.model_name = model_name
        self.host: ExecutorHost | None = None
        if args.executor_mem_gb > 0 and args.offload_executor is None:
            part = ForeignKVPartition(int(args.executor_mem_gb * GiB), runner.device)
            self.host = ExecutorHost(AttentionExecutor(part, executor_backend(runner.device, args)),
                                     staged_loads=not args.disable_ipc_staged_loads)
            logger.info("hosting executors for other models: %.2f GiB on %s", part.total_bytes / GiB, runner.device)
        # the sender's side: the directive in force and what earlier remotes sent and waited
        self.pairing = ""
        self.executor = ""
        self.state = ""
        self._done = [0, 0, 0.0, 0]  # bytes out, bytes in, wait seconds, staged loads of remotes already closed

    # ---- as a host ------------------------------------------------------------------------------
    def open_executor(self, msg: ExecutorOpen) -> ReplyOut:
        if self.host is None:
            return ReplyOut(rid=msg.rid, ok=False, data={"error": f"worker {self.worker_id} offers no executor "
                                                                   "memory (executor_mem_gb is 0)"})
        try:
            data = self.host.open(msg)
        except ValueError as e:
            logger.warning("cannot host an executor for %s: %s", msg.guest, e)
            return ReplyOut(rid=msg.rid, ok=False, data={"error": str(e)})
        logger.info("hosting an executor for %s (model %s, pairing %s) at %s", msg.guest, msg.guest_model,
                    msg.pairing, data["store"])
        return ReplyOut(rid=msg.rid, ok=True, data=data)

    # ---- as a sender ----------------------------------------------------------------------------
    def apply(self, d: OffloadDirective, scheduler: Scheduler) -> None:
        if self.args.offload_executor is not None:
            self._fail(d, "this worker has an in-process executor (offload_executor)")
            return
        # A planned policy may pair at ratio 0 (nothing goes out until an OffloadRatio raises it).
        if d.detach or (d.ratio <= 0 and d.policy == "fixed"):
            self._detach(d, scheduler)
            return
        try:
            if d.policy not in POLICIES:
                raise ValueError(f"offload policy {d.policy!r} is not one of {', '.join(POLICIES)}")
            if not 0 <= d.ratio <= 1:
                raise ValueError(f"offload ratio must be in [0, 1], got {d.ratio}")
            if d.placement not in ("", "prefill"):
                raise ValueError(f"offload placement {d.placement!r} is not '' or 'prefill'")
            if not d.bound >= 0:
                raise ValueError(f"offload bound must be >= 0, got {d.bound}")
            asked = self.args.offload_transport
            check_served(asked)
            if asked is not None and d.transport != asked:
                raise ValueError(f"the router paired over {d.transport}; this worker sends over {asked}")
            remote = self._connect(d)
        except (ValueError, ExecutorLost) as e:
            self._fail(d, str(e))
            return
        self._retire(scheduler)
        self.runner.set_remote(remote)
        ob = d.bound if d.policy == "adrenaline" else None
        # Adrenaline placement: the router places requests on the executor at prefill; none move later
        placed_only = d.placement == "prefill"
        sender: RemoteSender[Req] = RemoteSender(remote, d.ratio, self.runner.pool, ob, placed_only=placed_only)
        scheduler.remote_residency.set_sender(sender)
        self.pairing, self.executor, self.state = d.pairing, d.executor, "active"
        logger.info("remote attention: %.0f%% of decoding requests to the executor on %s (pairing %s, %s, "
                    "policy %s)", 100 * d.ratio, d.executor, d.pairing, d.backend, d.policy)

    def set_ratio(self, m: OffloadRatio, scheduler: Scheduler) -> None:
        """A planner's new decision for the pairing in force; a stale one (another pairing) is ignored."""
        off = scheduler.remote_sender
        if off is None or m.pairing != self.pairing or self.state != "active":
            return
        if not (0 <= m.ratio <= 1 and m.bound >= 0):
            logger.warning("offload ratio update %s ignored: ratio %s (0..1), bound %s (>= 0)", m.pairing, m.ratio,
                           m.bound)
            return
        logger.debug("offload ratio %.3f -> %.3f, bound %s -> %s", off.ratio, m.ratio, off.ob, m.bound)
        off.ratio = m.ratio
        if off.ob is not None:  # policy adrenaline: C1/C2 under the new bound
            off.ob = m.bound

    def _connect(self, d: OffloadDirective) -> RemoteAttention:
        spec, dev = guest_spec(self.runner), self.runner.device
        if d.transport == "cuda_ipc":
            from sglang_ext.offload.ipc import IpcRemote

            return IpcRemote.connect_ipc(d.store, dev, spec, d.executor, d.timeout_s,
                                         max(self.args.resolved_max_running_requests, 1), gpu_uuid(dev))
        if d.transport != "torch_dist":
            raise ValueError(f"unknown offload transport {d.transport!r}")
        return DistRemote.connect(d.store, d.backend, dev, spec, d.executor, d.timeout_s)

    def _fail(self, d: OffloadDirective, why: str) -> None:
        logger.warning("offload directive %s not applied: %s", d.pairing, why)
        self.pairing, self.executor, self.state = d.pairing, "", f"failed: {why}"

    def _detach(self, d: OffloadDirective, scheduler: Scheduler) -> None:
        off = scheduler.remote_sender
        if off is None or d.pairing != self.pairing:
            return  # not the pairing in force (already replaced, or never applied)
        off.ratio = 0.0  # choose() takes no more; those out there finish (or are recomputed if it is gone)
        self.state = "draining"
        logger.info("detaching from the executor on %s: %d request(s) finish there", self.executor, off.num_remote)
        self.after_step(scheduler)

    def after_step(self, scheduler: Scheduler) -> None:
        """Close a pair that is lost, or drained after a detach."""
        off = scheduler.remote_sender
        if off is None or self.args.offload_executor is not None:
            return
        if not off.active or not off.remote.alive:
            self._retire(scheduler)
            self.state = "lost"
        elif self.state == "draining" and off.num_remote == 0:
            self._retire(scheduler)
            self.state, self.executor = "", ""

    def _retire(self, scheduler: Scheduler) -> None:
        off = scheduler.remote_sender
        if off is None:
            return
        scheduler.remote_residency.set_sender(None)
        r = off.remote
        self._done = [self._done[0] + r.bytes_out, self._done[1] + r.bytes_in, self._done[2] + r.wait_s,
                      self._done[3] + r.staged_loads]
        r.close()

    def close(self, scheduler: Scheduler | None = None) -> bool:
        """At exit: say goodbye to this sender's executor; True while hosted pairings still run
        (their threads wait on their senders and end when those go)."""
        off = scheduler.remote_sender if scheduler is not None else None
        if off is not None and self.args.offload_executor is None:
            off.remote.close()
        return bool(self.host and self.host.services)

    # ---- reports --------------------------------------------------------------------------------
    def info(self, info: WorkerInfo) -> WorkerInfo:
        spec = guest_spec(self.runner)
        g = spec.geometry
        return msgspec.structs.replace(
            info, num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=spec.head_dim,
            num_q_heads=spec.num_q_heads, attn_scale=spec.scale, kv_dtype=str(g.dtype).removeprefix("torch."),
            executor_mem_bytes=self.host.capacity_bytes if self.host else 0, hostname=socket.gethostname(),
            gpu_uuid=gpu_uuid(self.runner.device), offload_transport=self.args.offload_transport or "")

    def report(self, scheduler: Scheduler) -> tuple[OffloadSender | None, ExecutorKV | None]:
        """The load report's parts: the sender's offload figures and the host's KV held per guest model
        (None where there is nothing to report)."""
        off = scheduler.remote_sender
        r: RemoteAttention | None = off.remote if off is not None else None
        state = self.state
        used = self.host.used_tokens() if self.host else {}
        if isinstance(r, LocalRemote):  # the in-process executor hosts this worker's own model
            used[self.model_name] = r.executor.used_tokens(r.guest)
            state = "active" if r.alive else "lost"
        state, _, error = state.partition(": ")  # `failed: why` after a failure
        sender = OffloadSender(
            reqs=off.num_remote if off else 0, bytes_out=int(self._done[0] + (r.bytes_out if r else 0)),
            bytes_in=int(self._done[1] + (r.bytes_in if r else 0)), wait_s=self._done[2] + (r.wait_s if r else 0.0),
            staged_loads=int(self._done[3] + (r.staged_loads if r else 0)), executor=r.executor_id if r else "",
            pairing=self.pairing, state=cast(OffloadState, state), error=error,
            ratio=off.ratio if off else 0.0, bound=(off.ob or 0.0) if off else 0.0)
        pairing, free = self.host.pairing_tokens() if self.host is not None else ({}, {})
        return present(sender), present(ExecutorKV(used_tokens=used, pairing_tokens=pairing, free_tokens=free))
