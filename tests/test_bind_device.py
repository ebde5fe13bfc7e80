"""A worker on cuda:N makes that GPU current on every thread that runs its model (the current CUDA
device is per thread; Triton kernels launch on it). Checked on CPU by recording the calls."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from sglang_ext.engine import model_runner
from sglang_ext.engine.model_runner import bind_device


def test_bind_device_sets_only_indexed_cuda_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for dev in ("cpu", "cuda", "cuda:1"):
        bind_device(dev)
    assert calls == [torch.device("cuda:1")]


def test_the_forward_thread_is_bound_to_the_workers_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_ext.worker import server

    seen: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append((threading.current_thread().name, d)))
    pool = server.forward_pool("cuda:1")
    try:
        pool.submit(lambda: None).result()
    finally:
        pool.shutdown()
    assert [(name.startswith("forward"), d) for name, d in seen] == [(True, torch.device("cuda:1"))]
    assert model_runner.bind_device is server.bind_device
