"""A worker's executor for other models' senders (`executor_mem_gb`): one ExecutorService thread per
pairing the router opens, all over one AttentionExecutor and its foreign-KV partition.

A guest is keyed by sender and pairing (`hot-0/p-1a2b-3`), so a sender paired again (it restarted,
or lost its executor for a while) never meets the pages of its previous pairing: those are released
when that pairing's thread ends.
"""

from __future__ import annotations

import threading
from typing import Final

import torch

from sglang_ext.kvcache.pool import KVGeometry
from sglang_ext.messages import ExecutorOpen
from sglang_ext.offload.dist import ExecutorService, open_store, pair_backend
from sglang_ext.offload.executor import AttentionExecutor, GuestSpec
from sglang_ext.offload.transport import SERVED_DEFAULT

_DTYPES: Final = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def guest_spec_of(msg: ExecutorOpen) -> GuestSpec:
    if msg.dtype not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {msg.dtype!r} (one of {', '.join(_DTYPES)})")
    if min(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.page_size, msg.num_q_heads) < 1:
        raise ValueError("the guest's attention shape has a zero or negative size")
    geo = KVGeometry(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.page_size, _DTYPES[msg.dtype])
    return GuestSpec(geo, msg.num_q_heads, msg.head_dim, msg.scale)


class ExecutorHost:
    def __init__(self, executor: AttentionExecutor, address: str = "127.0.0.1") -> None:
        self.executor = executor
        self.address = address  # where senders reach this worker (the interface toward the router)
        self.lock = threading.Lock()
        self.services: dict[str, ExecutorService] = {}
        self.guest_models: dict[str, str] = {}  # guest key -> the guest's model name

    def open(self, msg: ExecutorOpen) -> dict[str, str]:
        """Start serving a new pairing; returns the rendezvous address and backend for the sender.
        ValueError when this executor cannot host the guest."""
        if msg.transport != SERVED_DEFAULT:
            raise ValueError(f"this executor serves transport {SERVED_DEFAULT}, not {msg.transport}")
        spec = guest_spec_of(msg)
        key = f"{msg.guest}/{msg.pairing}"
        if key in self.services:
            raise ValueError(f"pairing {msg.pairing} of {msg.guest} is open already")
        with self.lock:
            self.executor.attach(key, spec)  # ValueError: a page larger than a slab
        backend, wire = pair_backend(self.executor.device, torch.device(msg.guest_device))
        try:
            store, listener = open_store(self.address)
        except (OSError, RuntimeError) as e:
            with self.lock:
                self.executor.detach(key)
            raise ValueError(f"cannot open a rendezvous on {self.address}: {e}") from None
        svc = ExecutorService(self.executor, self.lock, key, spec, store, backend, wire, self.address,
                              msg.timeout_s, on_exit=self._ended, listener=listener)
        self.services[key] = svc
        self.guest_models[key] = msg.guest_model
        svc.start()
        return {"store": f"{self.address}:{store.port}", "backend": backend}

    def _ended(self, svc: ExecutorService) -> None:  # on the service's thread
        self.services.pop(svc.guest, None)
        self.guest_models.pop(svc.guest, None)

    @property
    def capacity_bytes(self) -> int:
        return self.executor.partition.total_bytes

    def used_tokens(self) -> dict[str, int]:
        """KV tokens held per guest model (a report; read without the lock, so it may be a step old)."""
        out: dict[str, int] = {}
        for key, model in list(self.guest_models.items()):
            g, pg = self.executor.guests.get(key), self.executor.partition.guests.get(key)
            if g is not None and pg is not None:
                out[model] = out.get(model, 0) + pg.used * g.spec.geometry.page_size
        return out
