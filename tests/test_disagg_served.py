"""Served prefill/decode disaggregation through `python -m sglang_ext.launch`: the default model has a
prefill worker and a decode worker (`role:` in the cluster file), paired by the router over
torch.distributed/gloo; model `ref` is the same embedded model served by one plain worker.

Greedy outputs are `ref`'s (prompts sharing a prefix, repeated so the prefill worker's prefix cache
hits), streaming and the OpenAI endpoints included; a client that goes away mid-stream leaves no
request and no page behind on either worker; SGLang frontend programs run unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml
from _router_util import ROOT, Server, free_port, serve, sse_events, start_worker, wait_for

# `SGLANG_EXT_TEST_DEVICE=cuda` (two GPUs): the prefill worker and `ref` on cuda:0, the decode worker on
# cuda:1 (or SGLANG_EXT_TEST_DECODE_DEVICE), so the KV goes GPU to GPU as CUDA IPC peer copies, two
# processes of one node (the torch backend keeps float32 outputs comparable).
TWO_GPUS = os.environ.get("SGLANG_EXT_TEST_DEVICE", "cpu") == "cuda"
ARGS = {"max_total_tokens": 8192, "dtype": "float32", "device": "cuda:0" if TWO_GPUS else "cpu", "log_level": "warning",
        **({"attention_backend": "torch", "disable_cuda_graph": True} if TWO_GPUS else {})}
DECODE_DEVICE = os.environ.get("SGLANG_EXT_TEST_DECODE_DEVICE", "cuda:1") if TWO_GPUS else "cpu"
LONG = "A list of fruits: apples, pears, plums, cherries, grapes, bananas, oranges, lemons, limes, figs"
PROMPTS = ["The weather today is", "The weather today is sunny and the", "Once upon a time,", "Hi", LONG,
           LONG + ", dates and"]  # the last two share more than a page (16 tokens)


def cluster(tmp: Any, port: int, prefill_args: dict[str, Any] | None = None,
            prefill_env: dict[str, str] | None = None) -> str:
    prefill = {"id": "pd-prefill", "role": "prefill", "args": prefill_args or {}, "env": prefill_env or {}}
    cfg = {"router": {"port": port, "log_level": "info"},
           "models": [{"args": ARGS, "workers": [prefill,
                                                 {"id": "pd-decode", "role": "decode", "device": DECODE_DEVICE}]},
                      {"name": "ref", "args": ARGS}]}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def pd_idle(srv: Server) -> bool:
    """Nothing in flight, and neither worker runs, queues or holds a page outside its prefix cache."""
    if srv.info()["num_inflight_requests"]:
        return False
    for wid in ("pd-prefill", "pd-decode"):
        load = srv.worker(wid)["load"]
        if load["num_running"] or load["num_waiting"] or load["kv_used_tokens"] != load["kv_cached_tokens"]:
            return False
    return True


def pair_state(srv: Server) -> str:
    (p,) = srv.info()["disaggregation"]
    assert (p["prefill"], p["decode"]) == ("pd-prefill", "pd-decode")
    if p["state"] == "active":
        assert p["backend"] == ("cuda_ipc" if TWO_GPUS else "gloo"), p
    return str(p["state"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("disagg")
    port = free_port()
    with serve(tmp, ["--config", cluster(tmp, port)], workers=3, port=port) as srv:
        wait_for(lambda: pair_state(srv) == "active", 60, "the KV pair opened")
        yield srv


def generate(srv: Server, model: str, text: Any, max_new: int = 16, **kw: Any) -> Any:
    with srv.client(timeout=180) as c:
        r = c.post("/generate", json={"text": text, "model": model, **kw, "sampling_params": {
            "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_outputs_equal_a_plain_worker(server: Server) -> None:
    want = generate(server, "ref", PROMPTS)
    for _ in range(2):  # the second time, the prefill worker's prefix cache holds the prompts
        got = generate(server, "default", PROMPTS)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        assert [o["text"] for o in got] == [o["text"] for o in want]
        for o in got:
            m = o["meta_info"]
            assert (m["prefill_worker"], m["decode_worker"]) == ("pd-prefill", "pd-decode")
            assert m["completion_tokens"] == 16 and m["finish_reason"]["type"] == "length"
            assert m["prompt_tokens"] == next(w for w in want if w["text"] == o["text"])["meta_info"]["prompt_tokens"]
    assert max(o["meta_info"]["cached_tokens"] for o in got) > 0
    # Done at the first token: the decode worker is never involved.
    one = generate(server, "default", "Hi", max_new=1)
    assert one["output_ids"] == generate(server, "ref", "Hi", max_new=1)["output_ids"]
    assert one["meta_info"]["decode_worker"] is None


def test_streaming(server: Server) -> None:
    want = generate(server, "ref", PROMPTS[2], max_new=20)
    body = {"text": PROMPTS[2], "stream": True, "sampling_params": {"max_new_tokens": 20, "temperature": 0,
                                                                    "ignore_eos": True}}
    with server.client() as c, c.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        events = list(sse_events(r.iter_lines()))
    assert len(events) > 2
    assert events[-1]["output_ids"] == want["output_ids"] and events[-1]["text"] == want["text"]
    assert events[0]["meta_info"]["prefill_worker"] == "pd-prefill"
    assert events[-1]["meta_info"]["decode_worker"] == "pd-decode"


def test_openai_endpoints(server: Server) -> None:
    def complete(model: str, stream: bool) -> str:
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stream": stream}
        with server.client() as c:
            if not stream:
                return str(c.post("/v1/completions", json=body).json()["choices"][0]["text"])
            with c.stream("POST", "/v1/completions", json=body) as r:
                return "".join(e["choices"][0]["text"] for e in sse_events(r.iter_lines()) if e["choices"])

    def chat(model: str, stream: bool) -> str:
        body = {"model": model, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12,
                "temperature": 0, "stream": stream}
        with server.client() as c:
            if not stream:
                return str(c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"])
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                return "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_events(r.iter_lines())
                               if e["choices"])

    for fn in (complete, chat):
        want = fn("ref", False)
        assert want and fn("default", False) == want and fn("default", True) == want


def test_abort_mid_stream_frees_both_workers(server: Server) -> None:
    body = {"text": PROMPTS[1], "stream": True, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    with server.client() as c, c.stream("POST", "/generate", json=body) as r:
        events = sse_events(r.iter_lines())
        for _ in range(3):
            next(events)
    # the client is gone: nothing runs on either worker, and every page is back (or in the prefix cache)

    wait_for(lambda: pd_idle(server), 20, "both workers idle with no page held")
    assert generate(server, "default", PROMPTS[3])["meta_info"]["decode_worker"] == "pd-decode"


def test_frontend_programs(server: Server) -> None:
    """The SGLang frontend (RuntimeEndpoint: gen, stream, select, fork, chat, constrained gen) through
    the disaggregated default model; its answers equal the plain worker's."""
    pytest.importorskip("sglang", reason="the sglang frontend is not installed (scripts/setup.sh installs it)")
    p = subprocess.run([sys.executable, "tests/frontend/programs.py", server.url], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    result = json.loads(lines[-1][len("RESULT "):])

    def ref(text: str, **sp: Any) -> str:
        r = httpx.post(server.url + "/generate", json={"text": text, "model": "ref",
                                                        "sampling_params": {"temperature": 0, **sp}})
        return str(r.json()["text"])

    assert result["qa"]["answer"] == ref("Q: What is one plus one?\nA:", max_new_tokens=12, stop=["\n"])
    assert result["capped"] == ref("Once upon a time", max_new_tokens=6)
    assert "".join(result["stream_pieces"]) == result["stream_final"] == ref("Q: Say something.\nA:",
                                                                             max_new_tokens=12, stop=["\n"])
    assert result["select"] in (" red", " blue", " green")
    s = result["structured"]
    assert len(s["phone"]) == 8 and s["phone"][3] == "-" and s["answer"] in ("yes", "no")
    assert set(json.loads(s["person"])) == {"name", "age"}
    assert server.worker("pd-decode")["num_served"] > 0


def test_a_worker_that_joins_by_itself_says_its_role(server: Server, tmp_path: Any) -> None:
    """`launch worker --router ... --disaggregation-mode decode`: its hello makes it a decode worker, the
    router pairs it with the prefill worker, and the least loaded decode worker (the new, idle one)
    takes requests."""
    gpu = ["--device", DECODE_DEVICE, "--attention-backend", "torch", "--disable-cuda-graph"] if TWO_GPUS else []
    proc = start_worker(tmp_path, server.worker_addr, "pd-decode-2",
                        ["--disaggregation-mode", "decode", "--dtype", "float32", *gpu])
    try:
        wait_for(lambda: server.worker("pd-decode-2")["up"], 120, "pd-decode-2 joined")
        assert server.worker("pd-decode-2")["role"] == "decode"
        wait_for(lambda: any(p["decode"] == "pd-decode-2" and p["state"] == "active"
                             for p in server.info()["disaggregation"]), 30, "pd-prefill paired with pd-decode-2")
        want = generate(server, "ref", PROMPTS[2])["output_ids"]
        got = generate(server, "default", PROMPTS[2])
        assert got["meta_info"]["decode_worker"] == "pd-decode-2" and got["output_ids"] == want
    finally:
        proc.stop()
    # It left. Until its heartbeat times out the router may still count it up and place the next
    # request on its pair: then the send fails and the request is retried on the other pair (what the
    # client sees is the same either way; tests/test_disagg_router.py checks the retry itself).
    got = generate(server, "default", PROMPTS[2])
    assert got["output_ids"] == want and got["meta_info"]["decode_worker"] == "pd-decode"


def test_metrics(server: Server) -> None:
    def metrics() -> dict[str, float]:
        with server.client() as c:
            text = c.get("/metrics").text
        return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                if ln.startswith(("sglang_ext:kv_transfer", "sglang_ext:disagg_requests"))}

    generate(server, "default", PROMPTS[0], max_new=4)
    out = 'sglang_ext:kv_transfers_total{direction="out",model_name="default",worker="pd-prefill"}'
    got = 'sglang_ext:kv_transfers_total{direction="in",model_name="default",worker="pd-decode"}'
    m = wait_for(lambda: (m := metrics()).get(got, 0) > 0 and m.get(out, 0) > 0 and m, 10,
                 "transfers in a load report of each worker")
    assert m['sglang_ext:kv_transfer_bytes_total{direction="out",model_name="default",worker="pd-prefill"}'] > 0
    placed = m['sglang_ext:disagg_requests_total{event="placed",model_name="default"}']
    assert placed >= m['sglang_ext:disagg_requests_total{event="handed",model_name="default"}'] > 0
