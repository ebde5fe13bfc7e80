"""Served remote attention (`offload:` in the cluster file), through `python -m sglang_ext.launch`:
model `hot` (the embedded model) sends half of its decoding requests' attention and KV to an
executor hosted by the worker of model `cold` (another geometry), over torch.distributed/gloo.
With `SGLANG_EXT_TEST_DEVICE=cuda` (two GPUs) every test runs twice: over torch_dist (NCCL) and over
cuda_ipc (the two worker processes share buffers and GPU-side flags; the kill test then checks the
sender's watchdog: its stream, blocked on the dead executor's completion flags, drains and nothing hangs;
KV loads then go through the host's staging buffer, which the first test checks in hot's load report).

The reference is model `ref`: the same embedded model with the same arguments in the same
cluster, without an offload entry (a cluster without it, with one launch less). Greedy outputs of
`hot` equal `ref`'s, with offload running, and when the cold worker is SIGKILLed mid-generation.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from _router_util import ROOT, Server, free_port, serve, wait_for

from sglang_ext.models.default_model import ensure_default_model

# `SGLANG_EXT_TEST_DEVICE=cuda` with two GPUs: hot and ref on cuda:0, the executor on cuda:1, so the
# pairing runs over NCCL (the torch backend keeps float32 outputs comparable).
TWO_GPUS = os.environ.get("SGLANG_EXT_TEST_DEVICE", "cpu") == "cuda"
ARGS = {"max_total_tokens": 8192, "dtype": "float32", "device": "cuda:0" if TWO_GPUS else "cpu",
        "log_level": "warning", **({"attention_backend": "torch", "disable_cuda_graph": True} if TWO_GPUS else {})}
COLD_DEVICE = "cuda:1" if TWO_GPUS else "cpu"
PROMPTS = ["The weather today is", "Once upon a time,", "A list of fruits: apples, pears", "Hi",
           "Numbers: 1, 2, 3,", "Dear team,"]


def _cuda_ipc_missing() -> str | None:
    if importlib.util.find_spec("cuda") is None:
        return "cuda_ipc needs cuda-python (pip install cuda-python)"
    import torch

    if torch.cuda.device_count() < 2:
        return f"needs two GPUs, {torch.cuda.device_count()} visible"
    return None


TRANSPORTS = [None] if not TWO_GPUS else [
    "torch_dist", pytest.param("cuda_ipc", marks=pytest.mark.skipif(bool(_cuda_ipc_missing()),
                                                                    reason=str(_cuda_ipc_missing())))]


@pytest.fixture(scope="module", params=TRANSPORTS)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    transport = request.param  # None on CPU: chosen from the placement (torch_dist over gloo)
    tmp = tmp_path_factory.mktemp("offload")
    cold = tmp / "cold"  # a small Llama of another geometry: 2 layers, 4 heads (2 KV), head_dim 32
    cold.mkdir()
    (cold / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096, "vocab_size": 2048,
        "eos_token_id": 1, "bos_token_id": 0, "torch_dtype": "float32"}))
    port = free_port()
    cfg = {
        "router": {"port": port, "log_level": "info"},
        "models": [
            {"name": "hot", "args": {**ARGS, **({"offload_transport": transport} if transport else {})}},
            {"name": "ref", "args": ARGS},
            {"name": "cold", "model_path": str(cold),
             "args": {**ARGS, "device": COLD_DEVICE, "load_format": "dummy",
                      "tokenizer_path": str(ensure_default_model()), "max_total_tokens": 2048,
                      "executor_mem_gb": 0.05}},
        ],
        "offload": [{"from": "hot", "to": "cold", "policy": "fixed", "ratio": 0.5}],
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # Staged (GPU to GPU) KV loads are the default (cold has no --disable-ipc-staged-loads).
    with serve(tmp, ["--config", str(path)], workers=3, port=port) as srv:
        wait_for(lambda: pairing(srv)["state"] == "active", 60, "hot-0 paired with cold-0")
        assert pairing(srv)["transport"] == (transport or "torch_dist")
        yield srv


def pairing(srv: Server) -> dict[str, Any]:
    (p,) = srv.info()["offload"]
    return dict(p)


def generate(srv: Server, model: str, max_new: int) -> list[dict[str, Any]]:
    with srv.client(timeout=180) as c:
        r = c.post("/generate", json={"text": PROMPTS, "model": model,
                                      "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                                          "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return list(r.json())


def test_outputs_equal_without_offload(server: Server) -> None:
    p = pairing(server)
    assert p["from"] == "hot-0" and p["executor"] == "cold-0" and p["ratio"] == 0.5 and p["state"] == "active"
    want = [o["output_ids"] for o in generate(server, "ref", 24)]
    outs = generate(server, "hot", 24)
    assert [o["output_ids"] for o in outs] == want
    where = [o["meta_info"]["attention_executor"] for o in outs]
    assert "cold-0" in where and None in where and set(where) == {"cold-0", None}, where
    assert all(o["meta_info"]["attention_executor"] is None for o in generate(server, "ref", 2))

    def offload_metrics() -> dict[str, float]:
        with server.client() as c:
            text = c.get("/metrics").text
        return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                if ln.startswith(("sglang_ext:offload", "sglang_ext:executor_kv"))}

    m = wait_for(lambda: (m := offload_metrics()) and m.get(
        'sglang_ext:offload_bytes_total{direction="in",model_name="hot",worker="hot-0"}', 0) > 0 and m, 10,
        "the sender's bytes in a load report")
    assert m['sglang_ext:offload_bytes_total{direction="out",model_name="hot",worker="hot-0"}'] > 0
    assert m['sglang_ext:offload_wait_seconds_total{model_name="hot",worker="hot-0"}'] > 0
    assert 'sglang_ext:offloaded_reqs{model_name="hot",worker="hot-0"}' in m
    # cuda_ipc: the requests' KV (a page each here) went GPU to GPU through the host's stage
    # (transport/stage.py), not over the gloo control channel; torch_dist has no stage.
    if p["transport"] == "cuda_ipc":
        wait_for(lambda: server.worker("hot-0")["load"].get("offload_staged_loads", 0) > 0, 10,
                 "staged KV loads in hot-0's load report")
    else:
        assert server.worker("hot-0")["load"]["offload_staged_loads"] == 0
    used = 'sglang_ext:executor_kv_used_tokens{guest_model="hot",worker="cold-0"}'
    assert used in m
    wait_for(lambda: offload_metrics()[used] == 0, 10, "the executor's KV given back")


def test_aborted_remote_requests_give_the_executors_kv_back(server: Server) -> None:
    """A client that goes away while its requests decode on the executor: the sender releases them
    there, and the host's partition is empty again (nothing leaks on the executor)."""
    used = lambda: server.worker("cold-0").get("load", {}).get("executor_kv_used_tokens", {}).get("hot", 0)  # noqa: E731
    with server.client(timeout=60) as c, c.stream(
            "POST", "/generate", json={"text": PROMPTS, "model": "hot", "stream": True,
                                       "sampling_params": {"max_new_tokens": 2000, "temperature": 0,
                                                           "ignore_eos": True}}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        wait_for(lambda: next(lines) is not None and used() > 0, 60, "hot's requests holding KV on the executor")
    # the stream is closed: the router aborts the requests, the sender releases their executor rows
    wait_for(lambda: used() == 0 and not server.worker("hot-0").get("load", {}).get("offloaded_reqs"), 30,
             "the executor's KV given back after the abort")
    outs = generate(server, "hot", 8)  # and the pairing still serves
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in generate(server, "ref", 8)]


def test_executor_killed_mid_generation(server: Server) -> None:
    """SIGKILL the cold worker while hot's requests decode there: all of them finish with the same
    output (recomputed locally), nothing hangs, hot keeps serving; the launcher restarts cold and the
    router pairs hot with it again."""
    t0 = time.monotonic()
    want = [o["output_ids"] for o in generate(server, "ref", 300)]
    ref_s = time.monotonic() - t0
    first = pairing(server)["pairing"]
    result: list[list[dict[str, Any]]] = []
    t = threading.Thread(target=lambda: result.append(generate(server, "hot", 300)))
    t.start()
    try:
        hot = wait_for(lambda: (w := server.worker("hot-0")).get("load", {}).get("offloaded_reqs") and w, 30,
                       "requests of hot decoding on the executor")
        assert hot["load"]["offload_executor"] == "cold-0"
        os.kill(server.worker("cold-0")["info"]["pid"], signal.SIGKILL)
        t_kill = time.monotonic()
    finally:
        t.join(120)
    assert not t.is_alive() and result, f"the hot requests did not finish:\n{server.log()[-4000:]}"
    assert [o["output_ids"] for o in result[0]] == want, server.log()[-4000:]
    assert time.monotonic() - t_kill < 60
    assert "cold-0" in {o["meta_info"]["attention_executor"] for o in result[0]}  # they had been remote
    # The kill came while they decoded there (the reference took ref_s): they were recomputed.
    assert "attention executor cold-0 lost" in server.log(), f"killed too late? ({ref_s:.1f} s to generate)"
    with server.client() as c:  # hot keeps serving
        r = c.post("/generate", json={"text": "still here", "model": "hot", "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200
    again = wait_for(lambda: (p := pairing(server))["state"] == "active" and p["pairing"] != first and p, 60,
                     "hot-0 paired again with the restarted cold-0")
    assert again["executor"] == "cold-0"
    outs = generate(server, "hot", 24)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in generate(server, "ref", 24)]


def test_cluster_file_offload_errors_are_one_line(tmp_path: Path) -> None:
    cfg = {"models": [{"name": "a"}, {"name": "b"}], "offload": [{"from": "a", "to": "b", "ratio": 0.5}]}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = subprocess.run([sys.executable, "-m", "sglang_ext.launch", "--config", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 2
    assert "offload[0]: no worker of 'b' offers executor memory" in p.stderr, p.stderr
    assert len([ln for ln in p.stderr.splitlines() if "error" in ln]) == 1
