"""Rotation as users see it: meta_info `rotations` and the worker's load report (a real Worker in
this process), the router's /metrics families for rotation, and TTFT/TPOT SLO attainment per model."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec

from router.metrics import RouterMetrics
from sglang_ext.messages import BatchOut, GenerateReq, LoadReport
from sglang_ext.messages.io import RotationStats
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.server_args import ServerArgs
from sglang_ext.worker.worker import Worker


def _report(**kw: Any) -> LoadReport:
    base: dict[str, Any] = dict(worker_id="w0", num_running=0, num_waiting=0, kv_used_tokens=0, kv_total_tokens=1,
                                kv_cached_tokens=0, num_preemptions=0, step_time_ms=0.0, timestamp=0.0)
    return LoadReport(**{**base, **kw})


def test_worker_reports_rotations_in_meta_info_and_load() -> None:
    w = Worker(ServerArgs(device="cpu", dtype="float32", page_size=4, max_total_tokens=96, preemption_mode="rotate",
                          schedule_policy="sf", kv_host_size_gb=1 / 1024, skip_tokenizer_init=True))
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    inbox = [GenerateReq(rid=f"r{i}", input_ids=[10 + i + j for j in range(30)], sampling_params=sp)
             for i in range(5)]
    meta: dict[str, dict[str, Any]] = {}
    peak = 0
    for _ in range(2000):
        for out in w.step(inbox):
            assert isinstance(out, BatchOut)
            for t in out.outs:
                meta[t.rid] = t.meta_info
        inbox = []
        rot = w.load_report().rotation
        peak = max(peak, rot.rotary_reqs if rot else 0)
        if not w.has_work():
            break
    assert sorted(meta) == [f"r{i}" for i in range(5)]
    assert all(m["finish_reason"]["type"] == "length" for m in meta.values())
    rep = w.load_report().rotation
    assert rep is not None
    assert rep.rotations_out == rep.rotations_in == sum(m["rotations"] for m in meta.values()) > 0
    assert rep.bytes_out > 0 and rep.bytes_in > 0 and peak > 0
    assert rep.rotary_reqs == 0 and rep.host_used_bytes == 0 and rep.host_total_bytes >= 1 << 20


def test_rotation_metrics_render_and_stay_monotonic_across_restarts() -> None:
    w = SimpleNamespace(model="m", worker_id="w0", load=None, inflight={}, up=True, supervision=None)
    m = RouterMetrics(lambda: [w])  # type: ignore[arg-type, list-item]
    w.load = _report(rotation=RotationStats(rotary_reqs=2, host_used_bytes=4096, host_total_bytes=1 << 20,
                                            rotations_out=3, rotations_in=1, bytes_out=6144, bytes_in=2048,
                                            unhidden_iterations=1))
    w.load = msgspec.structs.replace(w.load, num_preemptions=5)
    m.offload.observe("w0", w.load)
    m.offload.restarted("w0")
    w.load = _report(rotation=RotationStats(rotations_out=1, bytes_out=100), num_preemptions=2)
    m.offload.observe("w0", w.load)
    text = m.render().decode()
    want = [
        'sglang_ext:kv_rotations_total{direction="out",model_name="m",worker="w0"} 4.0',
        'sglang_ext:kv_rotations_total{direction="in",model_name="m",worker="w0"} 1.0',
        'sglang_ext:kv_rotation_bytes_total{direction="out",model_name="m",worker="w0"} 6244.0',
        'sglang_ext:kv_rotation_bytes_total{direction="in",model_name="m",worker="w0"} 2048.0',
        'sglang_ext:kv_rotation_unhidden_iterations_total{model_name="m",worker="w0"} 1.0',
        'sglang_ext:num_preemptions_total{model_name="m",worker="w0"} 7.0',  # recompute preemptions, kept monotonic
        'sglang_ext:rotary_reqs{model_name="m",worker="w0"} 0.0',
        'sglang_ext:kv_host_used_bytes{model_name="m",worker="w0"} 0.0',
    ]
    for line in want:
        assert line in text, line


def test_slo_attainment_per_model() -> None:
    m = RouterMetrics()
    for met in (True, True, False, True):
        m.slo_result("a", "ttft", met)
    m.slo_result("a", "tpot", False)
    text = m.render().decode()
    assert 'sglang_ext:slo_attainment{kind="ttft",model_name="a"} 0.75' in text
    assert 'sglang_ext:slo_attainment{kind="tpot",model_name="a"} 0.0' in text
    assert 'sglang_ext:slo_checked_total{kind="ttft",model_name="a"} 4.0' in text
    assert 'sglang_ext:slo_met_total{kind="ttft",model_name="a"} 3.0' in text
