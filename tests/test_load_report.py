"""The load report's layout: a base plus one part per mechanism on the wire, decoded strictly (an
offload state outside its Literal is refused), and the flat names /get_server_info shows (a user
contract, unchanged by the nesting)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from sglang_ext.messages import LoadReport, decode_from_worker, encode
from sglang_ext.messages.io import ExecutorKV, KVTransferStats, Latency, OffloadSender, RotationStats
from sglang_ext.scheduler.scheduler import Scheduler

# /get_server_info's `load` keys, in order, as clients have always read them
FLAT_KEYS = [
    "type", "worker_id", "num_running", "num_waiting", "kv_used_tokens", "kv_total_tokens", "kv_cached_tokens",
    "num_preemptions", "step_time_ms", "timestamp", "decode_context_tokens", "offloaded_reqs", "offload_bytes_out",
    "offload_bytes_in", "offload_wait_s", "offload_staged_loads", "offload_executor", "offload_pairing",
    "offload_state", "offload_ratio", "offload_bound", "executor_kv_used_tokens", "executor_kv_pairing_tokens",
    "executor_kv_free_tokens", "tpot_p99_ms", "tpot_samples", "ttft_p99_ms", "ttft_samples", "decode_step_ms",
    "decode_steps", "rotary_reqs", "kv_host_used_bytes", "kv_host_total_bytes", "kv_rotations_out",
    "kv_rotations_in", "kv_rotation_bytes_out", "kv_rotation_bytes_in", "kv_rotation_unhidden_iterations",
    "kv_transfers_out", "kv_transfers_in", "kv_transfer_bytes_out", "kv_transfer_bytes_in",
]
BASE = dict(worker_id="w", num_running=3, num_waiting=1, kv_used_tokens=64, kv_total_tokens=128, kv_cached_tokens=8,
            num_preemptions=2, step_time_ms=4.5, timestamp=12.0)


def full() -> LoadReport:
    return LoadReport(
        **BASE, decode_context_tokens=1500.5,
        latency=Latency(tpot_p99_ms=20.0, tpot_samples=5, ttft_p99_ms=300.0, ttft_samples=4, decode_step_ms=15.0,
                        decode_steps=40),
        offload=OffloadSender(reqs=2, bytes_out=10, bytes_in=20, wait_s=0.5, staged_loads=1, executor="cold-0",
                              pairing="p1", state="failed", error="no room", ratio=0.5, bound=0.25),
        executor=ExecutorKV(used_tokens={"hot": 32}, pairing_tokens={"p1": 32}, free_tokens={"p1": 96}),
        rotation=RotationStats(rotary_reqs=1, host_used_bytes=4096, host_total_bytes=8192, rotations_out=3,
                               rotations_in=2, bytes_out=300, bytes_in=200, unhidden_iterations=1),
        disagg=KVTransferStats(transfers_out=7, transfers_in=6, bytes_out=700, bytes_in=600))


def test_the_parts_travel_and_decode_strictly() -> None:
    r = full()
    assert decode_from_worker(encode(r)) == r
    raw = msgspec.msgpack.decode(encode(r))
    raw["offload"]["state"] = "gone"
    with pytest.raises(msgspec.ValidationError):
        decode_from_worker(msgspec.msgpack.encode(raw))
    # a worker with no mechanism running sends the base only (and its latency)
    bare = decode_from_worker(encode(LoadReport(**BASE)))
    assert isinstance(bare, LoadReport)
    assert (bare.offload, bare.executor, bare.rotation, bare.disagg) == (None, None, None, None)
    assert bare.latency == Latency()


def test_the_flat_view_keeps_the_names_clients_read() -> None:
    flat = full().flat()
    assert list(flat) == FLAT_KEYS
    assert flat["offloaded_reqs"] == 2 and flat["offload_state"] == "failed: no room"
    assert flat["executor_kv_used_tokens"] == {"hot": 32} and flat["executor_kv_free_tokens"] == {"p1": 96}
    assert flat["kv_rotation_unhidden_iterations"] == 1 and flat["kv_host_total_bytes"] == 8192
    assert flat["kv_transfer_bytes_in"] == 600 and flat["decode_step_ms"] == 15.0 and flat["num_preemptions"] == 2
    assert flat["decode_context_tokens"] == 1500.5
    bare = LoadReport(**BASE).flat()
    assert list(bare) == FLAT_KEYS and bare["offload_state"] == "" and bare["executor_kv_used_tokens"] == {}
    assert bare["kv_transfers_out"] == 0 and bare["rotary_reqs"] == 0 and msgspec.json.encode(bare)
    assert bare["decode_context_tokens"] == 0.0  # an older worker's report: unknown to the planner


def test_the_decode_context_is_the_mean_length_of_the_decoding_requests() -> None:
    """Prompt + output tokens of the running requests that have a token out (offloaded ones too: their
    KV is elsewhere but they are as long); those still in prefill have no say; none decoding: 0."""
    def req(prompt: int, out: int) -> SimpleNamespace:
        return SimpleNamespace(input_ids=[0] * prompt, output_ids=[1] * out,
                               fill_len=prompt + out, remote=None)

    running = [req(1000, 24), req(3000, 0), req(5000, 976), req(2000, 0)]
    running[2].remote = 7  # on the executor
    assert Scheduler.decode_context(SimpleNamespace(running=running)) == 3500.0  # type: ignore[arg-type]
    assert Scheduler.decode_context(SimpleNamespace(running=[running[1]])) == 0.0  # type: ignore[arg-type]
    assert Scheduler.decode_context(SimpleNamespace(running=[])) == 0.0  # type: ignore[arg-type]
