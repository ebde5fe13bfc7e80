"""A worker's handling of the router's offload messages, without sockets: two `Worker`s of the
embedded model in this process, one hosting an executor (`executor_mem_gb`), one sending to it after
an `OffloadDirective`; then a detach. Also what load reports and hellos say about offload."""

from __future__ import annotations

from typing import Any

import pytest

from sglang_ext.messages import BatchOut, ExecutorOpen, GenerateReq, LoadReport, OffloadDirective, ReplyOut
from sglang_ext.messages.io import ExecutorKV, OffloadSender
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.server_args import ServerArgs
from sglang_ext.worker.tokenizer import StartupError
from sglang_ext.worker.worker import Worker

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21], [22, 23, 24, 25]]


def sent(r: LoadReport) -> OffloadSender:
    """The report's sender part (zeros where it has none)."""
    return r.offload or OffloadSender()


def hosted(r: LoadReport) -> ExecutorKV:
    """The report's host part (empty where it has none)."""
    return r.executor or ExecutorKV()


def make(worker_id: str, **kw: Any) -> Worker:
    return Worker(ServerArgs(device="cpu", dtype="float32", page_size=4, max_total_tokens=4096, **kw), worker_id)


def run(w: Worker, tag: str, max_new: int = 10, each: Any = None) -> tuple[list[list[int]], list[Any]]:
    """Generate PROMPTS greedily; returns the outputs and each request's attention_executor."""
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    inbox: list[Any] = [GenerateReq(rid=f"{tag}{i}", input_ids=p, sampling_params=sp) for i, p in enumerate(PROMPTS)]
    out: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(PROMPTS))}
    where: dict[str, Any] = {}
    for _ in range(500):
        for m in w.step(inbox):
            if isinstance(m, BatchOut):
                for o in m.outs:
                    out[o.rid].extend(o.token_ids)
                    where[o.rid] = o.meta_info["attention_executor"]
        inbox = []
        if each is not None:
            each(w)
        if not w.has_work():
            break
    return list(out.values()), [where[r] for r in out]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return run(make("ref-0"), "a")[0]


def open_for(sender: Worker, host: Worker) -> OffloadDirective:
    """What the router does: ExecutorOpen to the host (with the sender's hello), then a directive."""
    i = sender.info()
    (reply,) = host.handle(ExecutorOpen(
        rid="x", guest=i.worker_id, guest_model=i.model_name, pairing="p1", num_layers=i.num_layers,
        num_kv_heads=i.num_kv_heads, head_dim=i.head_dim, page_size=i.page_size, dtype=i.kv_dtype,
        num_q_heads=i.num_q_heads, scale=i.attn_scale, guest_device=i.device))
    assert isinstance(reply, ReplyOut) and reply.ok, reply
    return OffloadDirective(pairing="p1", executor=host.worker_id, store=reply.data["store"],
                            backend=reply.data["backend"], ratio=0.5)


def test_a_directive_pairs_a_sender_with_a_hosting_worker(reference: list[list[int]]) -> None:
    host = make("cold-0", executor_mem_gb=0.02)
    sender = make("hot-0")
    assert host.info().executor_mem_bytes > 0 and sender.info().executor_mem_bytes == 0
    assert sender.info().num_layers == 4 and sender.info().kv_dtype == "float32"
    sender.handle(open_for(sender, host))
    seen: list[Any] = []
    outs, where = run(sender, "b", each=lambda w: seen.append((w.load_report(), host.load_report())))
    assert outs == reference
    assert "cold-0" in where and None in where
    assert max(sent(s).reqs for s, _ in seen) > 0 and max(hosted(h).used_tokens.get("default", 0) for _, h in seen) > 0
    last = sender.load_report().offload
    assert last is not None and last.executor == "cold-0" and last.state == "active" and last.pairing == "p1"
    assert last.bytes_out > 0 and last.bytes_in > 0 and last.wait_s > 0
    # detach: no new requests go out, the pair closes once those there are done
    sender.handle(OffloadDirective(pairing="p1", detach=True))
    assert sender.scheduler.remote_sender is None and sent(sender.load_report()).state == ""
    outs, where = run(sender, "c")
    assert outs == reference and where == [None] * len(PROMPTS)
    assert sent(sender.load_report()).bytes_out == last.bytes_out  # totals kept after the close
    svc = list(host.remote_control.host.services.values())  # type: ignore[union-attr]
    assert all(s.ended.wait(5) for s in svc) and hosted(host.load_report()).used_tokens == {}
    sender.remote_control.close(sender.scheduler)


def test_a_directive_the_sender_cannot_follow_is_reported() -> None:
    w = make("hot-1")
    w.handle(OffloadDirective(pairing="p9", executor="cold-9", store="127.0.0.1:1", ratio=0.5, timeout_s=1.0))
    r = sent(w.load_report())
    assert r.pairing == "p9" and r.state == "failed" and r.error.startswith("executor cold-9 at 127.0.0.1:1")
    assert r.state_text().startswith("failed: executor cold-9 at 127.0.0.1:1")
    assert w.scheduler.remote_sender is None
    host = make("cold-1")  # executor_mem_gb 0: no executor to open
    (reply,) = host.handle(ExecutorOpen(
        rid="y", guest="hot-1", guest_model="default", pairing="p", num_layers=4, num_kv_heads=4, head_dim=64,
        page_size=4, dtype="float32", num_q_heads=8, scale=0.125, guest_device="cpu"))
    assert isinstance(reply, ReplyOut) and not reply.ok and "offers no executor memory" in reply.data["error"]


def test_the_in_process_executor_reports_too(reference: list[list[int]]) -> None:
    w = make("solo-0", offload_ratio=0.5, offload_executor="local")
    seen: list[Any] = []
    outs, _ = run(w, "d", each=lambda w: seen.append(w.load_report()))
    assert outs == reference
    assert max(sent(r).reqs for r in seen) > 0 and max(hosted(r).used_tokens.get("default", 0) for r in seen) > 0
    r = sent(w.load_report())
    assert r.bytes_out > 0 and r.state == "active" and r.executor == "solo-0/local"


def test_an_unavailable_transport_is_an_error_at_start() -> None:
    with pytest.raises(StartupError, match="offload_transport cuda_ipc needs a GPU worker, this one runs on cpu"):
        make("x-0", offload_transport="cuda_ipc")
