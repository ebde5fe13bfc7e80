"""Remote attention with an in-process executor (`offload_executor="local"`): greedy outputs are
identical with offload on and off -- with prefix-cache hits, chunked prefill, preemption under KV
pressure, a full executor and a lost executor -- and pages stay accounted for on both sides after
every step (`run_all` checks the sender's pool and the executor's partition)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _tiny import greedy, make_scheduler, prompts, run_all

from sglang_ext.kvcache.pool import KVGeometry
from sglang_ext.offload.executor import AttentionExecutor, GuestSpec
from sglang_ext.offload.partition import ForeignKVPartition
from sglang_ext.offload.remote import ExecutorLost
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.scheduler.request import Req

LENGTHS = [5, 17, 33, 9, 40, 3, 21, 12]


def _reqs(max_new: int = 12, ps: list[list[int]] | None = None) -> list[Req]:
    return [Req(f"r{i}", p, greedy(max_new)) for i, p in enumerate(ps or prompts(LENGTHS))]


def _offloaded(**args: Any) -> Any:
    args.setdefault("offload_ratio", 0.5)
    return make_scheduler(offload_executor="local", **args)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return run_all(make_scheduler(), _reqs())


@pytest.mark.parametrize("ratio", [0.25, 0.5, 1.0])
def test_outputs_equal_without_offload(reference: dict[str, list[int]], ratio: float) -> None:
    s = _offloaded(offload_ratio=ratio)
    reqs = _reqs()
    assert run_all(s, reqs) == reference
    remote = [r for r in reqs if r.attention_executor is not None]
    assert len(remote) >= int(ratio * len(reqs) / 2)  # the share was really offloaded
    assert all(r.attention_executor == "tiny/local" for r in remote)
    assert s.remote_sender.remote.bytes_out > 0 and s.remote_sender.num_remote == 0
    assert s.remote_sender.remote.executor.partition.used_pages("tiny") == 0  # everything given back


def test_prefix_hits_and_chunked_prefill(reference: dict[str, list[int]]) -> None:
    s = _offloaded(chunked_prefill_size=7)
    run_all(s, _reqs())  # warm the prefix cache
    again = _reqs()
    assert run_all(s, again) == reference
    assert sum(r.cached_tokens for r in again) > 0
    assert any(r.attention_executor for r in again)


def test_shared_prefix_pages_stay_with_the_cache() -> None:
    """Offloading a request whose prompt pages are shared frees only its own pages locally."""
    base = prompts([24])[0]
    ps = [[*base, 7, 8, 9], [*base, 10, 11], [*base, 12]]
    want = run_all(make_scheduler(), _reqs(ps=ps))
    s = _offloaded(offload_ratio=0.67, chunked_prefill_size=16)
    reqs = _reqs(ps=ps)
    assert run_all(s, reqs) == want
    assert any(r.attention_executor for r in reqs) and reqs[1].cached_tokens >= 16


@pytest.mark.parametrize("ratio", [0.5, 1.0])
def test_preemption_under_kv_pressure(reference: dict[str, list[int]], ratio: float) -> None:
    s = _offloaded(max_total_tokens=64, offload_ratio=ratio)
    assert run_all(s, _reqs()) == reference
    assert s.num_preemptions > 0


def test_a_request_that_outgrows_both_pools_fails_alone() -> None:
    """40 + 12 tokens never fit a 48-token pool: offloaded, dropped by a full executor, it cannot
    come back either -- it ends with an explicit error and the queue behind it keeps moving."""
    s = _offloaded(max_total_tokens=48)
    reqs = _reqs()
    run_all(s, reqs)
    assert [r.finish_reason.type for r in reqs].count("abort") == 1
    assert "out of KV cache memory" in (reqs[4].finish_reason.message or "")


def test_a_full_executor_keeps_requests_local(reference: dict[str, list[int]]) -> None:
    """An executor with room for a few pages: loads that do not fit stay local; requests that
    cannot grow there are recomputed locally. Outputs do not change."""
    s = _offloaded(offload_ratio=1.0, executor_mem_gb=40 * 4096 / 2**30)  # ~40 pages of the tiny model
    reqs = _reqs(max_new=40)
    ref = run_all(make_scheduler(), _reqs(max_new=40))
    assert run_all(s, reqs) == ref
    assert any(r.attention_executor for r in reqs)
    assert any(r.attention_executor is None for r in reqs) or s.num_preemptions > 0


@pytest.mark.parametrize("after_steps", [3, 8])
def test_executor_lost_mid_generation(reference: dict[str, list[int]], after_steps: int) -> None:
    s = _offloaded()
    reqs = _reqs()
    for r in reqs:
        s.add_request(r)
    out: dict[str, list[int]] = {r.rid: [] for r in reqs}
    steps = 0
    remote = s.remote_sender.remote
    while s.has_work():
        if steps == after_steps:
            assert s.remote_sender.num_remote > 0, "nothing was offloaded yet"

            def gone(*_: object) -> None:
                raise ExecutorLost("the executor's worker died (simulated)")

            remote.post = gone  # the next remote layer fails, as a dead peer's transport would
        for o in s.step():
            out[o.rid].extend(o.new_token_ids)
        s.kv.check(s.running + s.waiting)
        steps += 1
        assert steps < 2000
    assert out == reference
    assert not s.remote_sender.active and s.num_preemptions > 0


def test_abort_of_a_remote_request_frees_executor_pages() -> None:
    s = _offloaded(offload_ratio=1.0)
    reqs = _reqs(max_new=30)
    for r in reqs:
        s.add_request(r)
    for _ in range(12):
        s.step()
    part = s.remote_sender.remote.executor.partition
    assert part.used_pages("tiny") > 0
    for r in reqs:
        s.abort(r.rid)
    while s.has_work():
        s.step()
    assert part.used_pages("tiny") == 0 and s.remote_sender.num_remote == 0
    assert s.allocator.num_free + s.kv.cache.size_info().cached_pages == s.allocator.capacity


def test_sampled_requests_offload_too() -> None:
    """Seeded sampling draws by (seed, position): remote or local, the same tokens."""
    params = [SamplingParams(max_new_tokens=10, temperature=0.9, top_k=40, seed=i) for i in range(len(LENGTHS))]
    mk = lambda: [Req(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(LENGTHS), params, strict=True))]  # noqa: E731
    assert run_all(_offloaded(), mk()) == run_all(make_scheduler(), mk())


# ---- the partition and the executor alone ---------------------------------------------------------
def test_partition_serves_several_geometries() -> None:
    part = ForeignKVPartition(1 << 20, "cpu", slab_bytes=1 << 16)
    a = KVGeometry(2, 2, 16, 4, torch.float32)  # 2 KiB pages
    b = KVGeometry(3, 1, 32, 8, torch.bfloat16)  # 3 KiB pages
    part.attach("a", a)
    part.attach("b", b)
    pa = part.alloc("a", 50)
    pb = part.alloc("b", 30)
    assert pa is not None and pb is not None and 0 not in pa and 0 not in pb
    part.check()
    # the byte ranges of a's and b's pages never overlap
    ra = {(p * a.page_bytes, (p + 1) * a.page_bytes) for p in pa}
    rb = {(p * b.page_bytes, (p + 1) * b.page_bytes) for p in pb}
    assert not any(x0 < y1 and y0 < x1 for x0, x1 in ra for y0, y1 in rb)
    assert part.alloc("a", 10_000) is None  # too much: nothing taken
    part.check()
    part.free("a", pa)
    assert part.used_pages("a") == 0 and not part.guests["a"].slabs  # slabs back to the arena
    assert part.alloc("b", 200) is not None  # b can now use a's former slabs
    part.check()
    with pytest.raises(ValueError, match="larger than a slab"):
        part.attach("c", KVGeometry(64, 8, 128, 16, torch.float32))


def test_executor_load_in_parts() -> None:
    """A load in parts (cuda_ipc's staged loads of KV larger than the stage) takes every page at once
    and lands the same KV as a load in one piece."""
    ex = AttentionExecutor(ForeignKVPartition(1 << 20, "cpu", slab_bytes=1 << 15))
    spec = GuestSpec(KVGeometry(2, 2, 16, 4, torch.float32), 4, 16, 0.25)
    ex.attach("g", spec)
    kv = torch.randn(5, 2, 2, 4, 2, 16)
    ex.load("g", 1, kv, 20)
    ex.load("g", 2, kv[:2], 20, num_pages=5)
    assert ex.used_tokens("g") == 40  # all five pages taken by the first part
    ex.write("g", 2, 2, kv[2:4])
    ex.write("g", 2, 4, kv[4:])
    data, seqs = ex.guests["g"].backend.pool.data, ex.guests["g"].seqs
    assert torch.equal(data[seqs[2].pages], data[seqs[1].pages]) and torch.equal(data[seqs[2].pages], kv)
    with pytest.raises(ValueError, match=r"pages 4\.\.6 of request 2, which has 5"):
        ex.write("g", 2, 4, kv[:2])
    ex.check()


def test_executor_attention_matches_local_backend() -> None:
    """The executor's attention over copied KV equals the local torch backend's (float32)."""
    from sglang_ext.attention.torch_backend import TorchAttentionBackend
    from sglang_ext.forward_batch import BatchRow, ForwardBatch, ForwardMode
    from sglang_ext.kvcache.pool import KVPool

    g = torch.Generator().manual_seed(0)
    geo = KVGeometry(2, 2, 16, 4, torch.float32)
    pool = KVPool(geo, 64, "cpu")
    pool.data.normal_(generator=g)
    local = TorchAttentionBackend(pool, 4, 16, 0.25)
    ex = AttentionExecutor(ForeignKVPartition(1 << 20, "cpu", slab_bytes=1 << 15))
    ex.attach("m", GuestSpec(geo, 4, 16, 0.25))
    lens = [5, 9, 13]
    tables = [[3, 4], [7, 8, 9], [10, 11, 12, 13]]
    for h, (n, t) in enumerate(zip(lens, tables, strict=True)):
        ex.load("m", h, pool.data[torch.tensor(t)][: -(-n // 4)], n)
    assert ex.plan("m", [0, 1, 2], lens) == []
    rows = [BatchRow(n, (0,), t) for n, t in zip(lens, tables, strict=True)]
    batch = ForwardBatch.build(rows, ForwardMode.DECODE, 4, "cpu")
    local.prepare(batch)
    q, k, v = (torch.randn(3, h, 16, generator=g) for h in (4, 2, 2))
    for layer in (0, 1):
        torch.testing.assert_close(ex.attend("m", layer, q, k, v), local.forward(q, k, v, layer, batch))
    ex.release("m", 1)
    ex.check()


def test_engine_with_an_in_process_executor(test_device: str) -> None:
    """`sglang_ext.Engine(offload_ratio=0.5, offload_executor="local")`: the embedded model, half the
    decoding requests on the executor, the same greedy outputs as without, and `attention_executor`
    in meta_info (the executor's id for offloaded requests, null for the others)."""
    from sglang_ext import Engine

    prompts_ = ["The weather today is", "Once upon a time,", "A list of fruits: apples, pears", "Hi",
                "Numbers: 1, 2, 3,", "Dear team,"]
    sp = {"max_new_tokens": 10, "temperature": 0}
    kw = {"device": test_device, "dtype": "float32", "page_size": 4, "max_total_tokens": 8192}
    with Engine(**kw) as eng:
        want = [o["output_ids"] for o in eng.generate(prompt=prompts_, sampling_params=sp)]
    with Engine(offload_ratio=0.5, offload_executor="local", **kw) as eng:
        outs = eng.generate(prompt=prompts_, sampling_params=sp)
    assert [o["output_ids"] for o in outs] == want
    where = [o["meta_info"]["attention_executor"] for o in outs]
    assert 1 <= sum(w is not None for w in where) <= 4 and None in where
    assert all(w is None or w.endswith("/local") for w in where)
    with pytest.raises(ValueError, match="offload_ratio"):
        Engine(offload_ratio=1.5, offload_executor="local", **kw)


def test_an_executor_on_the_same_gpu_comes_out_of_the_memory_fraction() -> None:
    """With `--offload-executor local` and `--executor-mem-gb`, the executor's partition is set aside
    inside `--mem-fraction-static`, as a hosted executor's is: offload on and off use the same share
    of the GPU. An executor on another GPU takes nothing from this one."""
    from sglang_ext.engine.model_runner import executor_set_aside
    from sglang_ext.server_args import ServerArgs

    gpu0, gib = torch.device("cuda:0"), 2**30

    def aside(**kw: Any) -> int:
        return executor_set_aside(ServerArgs(**kw), gpu0)

    assert aside(executor_mem_gb=7) == 7 * gib  # hosts executors for other workers
    assert aside(offload_executor="local", offload_ratio=0.5, executor_mem_gb=7) == 7 * gib
    assert aside(offload_executor="cuda:0", offload_ratio=0.5, executor_mem_gb=2) == 2 * gib
    assert aside(offload_executor="cuda", offload_ratio=0.5, executor_mem_gb=2) == 2 * gib
    assert aside(offload_executor="cuda:1", offload_ratio=0.5, executor_mem_gb=7) == 0
    assert aside(offload_executor="local", offload_ratio=0.5) == 0  # unsized: as large as the pool, on top
