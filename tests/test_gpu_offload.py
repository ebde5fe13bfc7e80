"""Remote attention on the GPU (bf16, FlashInfer, decode CUDA graphs for local-only batches): the
in-process executor on the same GPU and on a second GPU (`offload_executor="cuda:1"`, through torch
copies and through the GPU-signalled exchange) gives the
greedy tokens of the same model without offload. Skipped without CUDA / FlashInfer (two GPUs for
the second test)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if importlib.util.find_spec("flashinfer") is None:
    pytest.skip("needs flashinfer (pip install flashinfer-python)", allow_module_level=True)

from _tiny import EOS
from test_gpu_equivalence import GREEDY, VOCAB, _runner, _serve

from sglang_ext.offload.setup import local_sender
from sglang_ext.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.gpu


def _agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> float:
    """Share of tokens equal before each request's first difference (bf16 near-ties may differ)."""
    same = total = 0
    for rid, xs in a.items():
        ys = b[rid]
        total += len(xs)
        for x, y in zip(xs, ys, strict=False):
            if x != y:
                break
            same += 1
    return same / total


@pytest.mark.parametrize(("where", "transport"), [
    ("local", "local"), ("cuda:1", "local"),
    ("cuda:1", "cuda_ipc"),
])
def test_offload_keeps_greedy_tokens(where: str, transport: str) -> None:
    if where == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("needs a second GPU")
    plain = _runner("flashinfer")
    want = _serve(Scheduler(plain.args, plain, 16, frozenset([EOS]), vocab_size=VOCAB, overlap=True), GREEDY)
    r = _runner("flashinfer")
    args = dataclasses.replace(r.args, offload_ratio=0.5, offload_executor=where, offload_transport=transport)
    off = local_sender(args, r, "gpu")
    assert off is not None
    s = Scheduler(args, r, 16, frozenset([EOS]), vocab_size=VOCAB, remote_sender=off)
    reqs_before = off.remote.bytes_out
    got = _serve(s, GREEDY)
    agree = _agreement(want, got)
    print(f"offload to {where} ({transport}): {agree:.1%} of tokens agree before the first difference; "
          f"{(off.remote.bytes_out - reqs_before) / 2**20:.1f} MiB sent, wait {off.remote.wait_s * 1e3:.1f} ms")
    assert off.remote.bytes_out > reqs_before
    assert agree >= 0.9


def test_offload_with_the_model_in_an_sm_partition_keeps_greedy_tokens() -> None:
    """`executor_reserved_sms`: the model runs (and its graphs are captured) on a stream of a green
    context holding all SMs but 16, the in-process executor on the primary context's streams; the
    greedy tokens stay those of a plain run."""
    from sglang_ext.engine import sm_partition
    from sglang_ext.engine.model_runner import bind_device

    plain = _runner("flashinfer")
    want = _serve(Scheduler(plain.args, plain, 16, frozenset([EOS]), vocab_size=VOCAB, overlap=True), GREEDY)
    try:
        stream = sm_partition.make(torch.device("cuda:0"), 16)
        bind_device("cuda:0")
        assert torch.cuda.current_stream() == stream
        r = _runner("flashinfer")  # its decode graphs are captured on the partition's stream
        args = dataclasses.replace(r.args, offload_ratio=0.5, offload_executor="local", executor_reserved_sms=16)
        off = local_sender(args, r, "gpu")
        assert off is not None
        got = _serve(Scheduler(args, r, 16, frozenset([EOS]), vocab_size=VOCAB, remote_sender=off), GREEDY)
        assert torch.cuda.current_stream() == stream
    finally:
        sm_partition._streams.clear()
        torch.cuda.set_stream(torch.cuda.default_stream())
    assert _agreement(want, got) >= 0.9
