"""/tokenize, /detokenize, /abort_request, /start_profile, /stop_profile and /update_weights_from_disk
against a real launcher + worker (embedded default model, CPU), and the offline Engine's methods of the
same names."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from _router_util import SMALL, Server, serve, sse_events, wait_for

from sglang_ext.models.default_model import ensure_default_model

KEY = "admin-key"
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}
PROMPT = "The quick brown fox"


def second_checkpoint(dst: Path) -> Path:
    """The default model's files with other weights: each tensor plus seeded noise."""
    from safetensors.torch import load_file, save_file

    src = ensure_default_model()
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(7)
    tensors = load_file(str(src / "model.safetensors"))
    changed = {k: (v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.dim() == 2 else v).contiguous()
               for k, v in tensors.items()}
    save_file(changed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def other_shape_checkpoint(dst: Path) -> Path:
    src = ensure_default_model()
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("admin")


@pytest.fixture(scope="module")
def ckpt_b(tmp: Path) -> Path:
    return second_checkpoint(tmp / "ckpt-b")


@pytest.fixture(scope="module")
def server(tmp: Path) -> Iterator[Server]:
    with serve(tmp, SMALL, api_key=KEY) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def ids_of(c: httpx.Client, text: str = PROMPT, **sp: Any) -> list[int]:
    r = c.post("/generate", json={"text": text, "sampling_params": {**GREEDY, **sp}})
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"])


# ---- tokenize / detokenize ----------------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip(client: httpx.Client) -> None:
    r = client.post("/tokenize", json={"prompt": "Hello world, hello tokens"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"tokens", "count", "max_model_len"}
    ctx = client.get("/get_model_info").json()["context_length"]
    assert out["count"] == len(out["tokens"]) > 2 and out["max_model_len"] == ctx
    plain = client.post("/tokenize", json={"prompt": "Hello world, hello tokens", "add_special_tokens": False,
                                           "model": "default"}).json()
    assert out["tokens"][0] == 0 and plain["tokens"] == out["tokens"][1:]  # BOS (id 0) only with specials
    back = client.post("/detokenize", json={"tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"text": "Hello world, hello tokens"}
    kept = client.post("/detokenize", json={"tokens": out["tokens"], "skip_special_tokens": False}).json()
    assert kept["text"] == "<|begin_of_text|>Hello world, hello tokens"
    # Lists in, lists out
    many = client.post("/tokenize", json={"prompt": ["a b", "c d e f"]}).json()
    assert isinstance(many["tokens"][0], list) and many["count"] == [len(t) for t in many["tokens"]]
    texts = client.post("/detokenize", json={"tokens": many["tokens"]}).json()
    assert texts == {"text": ["a b", "c d e f"]}
    # What /generate would see
    gen = client.post("/generate", json={"text": "Hello world", "sampling_params": {**GREEDY, "max_new_tokens": 1}})
    n = client.post("/tokenize", json={"prompt": "Hello world"}).json()["count"]
    assert gen.json()["meta_info"]["prompt_tokens"] == n


def test_tokenize_errors(server: Server, client: httpx.Client) -> None:
    r = client.post("/detokenize", json={"tokens": [5, 99999]})
    assert r.status_code == 400 and "99999" in r.json()["error"]["message"] and "tokens" in r.json()["error"]["message"]
    r = client.post("/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400
    r = client.post("/tokenize", json={"prompt": "x", "model": "nope"})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = client.post("/tokenize", json={"model": "default"})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    r = client.post("/tokenize", json={"prompt": "x", "text": "x"})
    assert r.status_code == 400 and "text" in r.json()["error"]["message"]
    r = client.post("/detokenize", json={"tokens": "abc"})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]
    with httpx.Client(base_url=server.url) as anon:  # the router's API key, as everywhere
        assert anon.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert anon.post("/abort_request", json={"abort_all": True}).status_code == 401
        assert anon.post("/update_weights_from_disk", json={"model_path": "/x"}).status_code == 401
    assert client.post("/tokenize", json={"prompt": "still serving"}).status_code == 200


# ---- abort ---------------------------------------------------------------------------------------
def _in_background(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except Exception as e:  # surfaced by the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _running(server: Server, n: int) -> bool:
    return bool(server.info()["num_inflight_requests"] >= n)


def test_abort_a_running_generation_by_rid(server: Server, client: httpx.Client) -> None:
    t, box = _in_background(lambda: server.client().post(
        "/generate", json={"text": PROMPT, "sampling_params": LONG, "rid": "long-1"}))
    wait_for(lambda: _running(server, 1), 30, "the long request runs")
    time.sleep(0.3)
    r = client.post("/abort_request", json={"rid": "long-1"})
    assert r.status_code == 200 and r.json() == {"aborted": 1}
    t.join(30)
    resp = box["result"]
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 3000
    # The worker stopped it too (it runs nothing), and serves on.
    wait_for(lambda: all(w["load"]["num_running"] == 0 for m in server.info()["models"].values()
                         for w in m["workers"]), 10, "the worker dropped it")
    assert len(ids_of(client)) == 12
    # A request of n samples: its rid reaches them all
    t, box = _in_background(lambda: server.client().post(
        "/generate", json={"text": PROMPT, "sampling_params": {**LONG, "n": 2}, "rid": "pair"}))
    wait_for(lambda: _running(server, 2), 30, "both samples run")
    assert client.post("/abort_request", json={"rid": "pair"}).json() == {"aborted": 2}
    t.join(30)
    assert [o["meta_info"]["finish_reason"]["type"] for o in box["result"].json()] == ["abort", "abort"]
    # An unknown rid: a no-op, as in SGLang
    assert client.post("/abort_request", json={"rid": "no-such"}).json() == {"aborted": 0}
    r = client.post("/abort_request", json={})
    assert r.status_code == 400 and "rid" in r.json()["error"]["message"]


def test_abort_a_stream_by_rid_and_abort_all(server: Server, client: httpx.Client) -> None:
    body = {"text": PROMPT, "sampling_params": LONG, "rid": "long-s", "stream": True}
    with server.client() as c2, c2.stream("POST", "/generate", json=body) as r:
        events = sse_events(r.iter_lines())
        first = next(events)
        assert first["meta_info"]["finish_reason"] is None
        assert client.post("/abort_request", json={"rid": "long-s"}).json() == {"aborted": 1}
        rest = list(events)  # ends with [DONE]
    assert rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    # abort_all: a plain one and a streamed OpenAI one, on the one model
    t1, b1 = _in_background(lambda: server.client().post(
        "/generate", json={"text": PROMPT, "sampling_params": LONG}))
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
            "temperature": 0, "stream": True, "ignore_eos": True}

    def stream_chat() -> list[Any]:
        with server.client() as c3, c3.stream("POST", "/v1/chat/completions", json=chat) as s:
            return list(sse_events(s.iter_lines()))

    t2, b2 = _in_background(stream_chat)
    wait_for(lambda: _running(server, 2), 30, "both requests run")
    time.sleep(0.3)
    r = client.post("/abort_request", json={"abort_all": True, "model": "default"})
    assert r.status_code == 200 and r.json() == {"aborted": 2}
    t1.join(30)
    t2.join(30)
    assert b1["result"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert "error" not in b2, b2
    finals = [c for c in b2["result"] if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals and finals[-1]["choices"][0]["finish_reason"] == "abort"
    assert client.post("/abort_request", json={"abort_all": True, "model": "nope"}).status_code == 404
    assert len(ids_of(client)) == 12


def test_an_abort_names_a_request_or_its_samples_only() -> None:
    from router.core import _names

    assert _names("a", "a") and _names("a", "a-0") and _names("a", "a-12")
    assert not _names("r", "r-1a2b3c4d-7") and not _names("a", "ab") and not _names("", "x")


# ---- profiler ------------------------------------------------------------------------------------
def test_profile_start_stop_writes_a_trace(client: httpx.Client, tmp: Path) -> None:
    out = tmp / "prof"
    assert client.post("/stop_profile").status_code == 400  # nothing to stop
    r = client.post("/start_profile", json={"output_dir": str(out)})
    assert r.status_code == 200 and r.text.startswith("Start profiling."), r.text
    again = client.post("/start_profile", json={"output_dir": str(out)})
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    ids_of(client)
    r = client.post("/stop_profile")
    assert r.status_code == 200 and "Stop profiling." in r.text, r.text
    traces = list(out.glob("*.trace.json"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert json.loads(traces[0].read_text())["traceEvents"]
    assert "## by self CPU time" in next(out.glob("*.txt")).read_text()
    r = client.post("/stop_profile")
    assert r.status_code == 400 and "not running" in r.json()["error"]["message"]


def test_profile_num_steps_stops_by_itself(client: httpx.Client, tmp: Path) -> None:
    out = tmp / "prof-steps"
    r = client.post("/start_profile", json={"output_dir": str(out), "num_steps": 3, "activities": ["CPU"]})
    assert r.status_code == 200, r.text
    ids_of(client)  # 12 tokens: more than 3 steps
    trace = wait_for(lambda: list(out.glob("*.trace.json")), 30, "the trace of 3 steps")
    assert trace[0].stat().st_size > 0 and "steps 0..2" in next(out.glob("*.txt")).read_text()
    assert client.post("/stop_profile").status_code == 400  # it stopped already


def test_profile_bad_requests(client: httpx.Client) -> None:
    r = client.post("/start_profile", json={"activities": ["GPU"]})
    assert r.status_code == 400 and "runs on a CPU" in r.json()["error"]["message"]
    r = client.post("/start_profile", json={"activities": ["TPU"]})
    assert r.status_code == 400 and "TPU" in r.json()["error"]["message"]
    r = client.post("/start_profile", json={"num_steps": 0})
    assert r.status_code == 400 and "num_steps" in r.json()["error"]["message"]
    r = client.post("/start_profile", json={"output_dir": "/proc/no/such"})
    assert r.status_code == 400 and "output_dir" in r.json()["error"]["message"]


# ---- weights ---------------------------------------------------------------------------------------
def test_update_weights_from_disk(server: Server, client: httpx.Client, ckpt_b: Path, tmp: Path) -> None:
    from sglang_ext import Engine

    old = ids_of(client)
    with Engine(model_path=str(ckpt_b), device="cpu", dtype="float32", max_total_tokens=16384,
                log_level="warning") as eng:
        want_b = eng.generate(PROMPT, GREEDY)["output_ids"]  # type: ignore[index]
    assert want_b != old
    # A request in flight when the update comes finishes (on the old weights: the worker drains first);
    # one that comes while it drains waits, and runs on the new weights.
    t, box = _in_background(lambda: server.client().post(
        "/generate", json={"text": "in flight", "sampling_params": {**LONG, "max_new_tokens": 1000}}))
    wait_for(lambda: _running(server, 1), 30, "the request in flight")
    tu, update = _in_background(lambda: server.client().post("/update_weights_from_disk",
                                                             json={"model_path": str(ckpt_b)}))
    time.sleep(0.5)
    assert not update  # still draining
    assert ids_of(client) == want_b  # held, then served by the new weights
    tu.join(60)
    r = update["result"]
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["success"] is True and out["message"] and list(out["workers"]) == ["default-0"]
    t.join(60)
    done = box["result"].json()
    assert done["meta_info"]["finish_reason"] == {"type": "length", "length": 1000}
    assert ids_of(client) == want_b  # the new weights serve
    assert client.get("/get_model_info").json()["model_path"] == str(ckpt_b)
    # A bad path, another shape, a bad format: refused, the weights in force keep serving.
    for body, why in [({"model_path": str(tmp / "missing")}, "not a local directory"),
                      ({"model_path": str(other_shape_checkpoint(tmp / "wide"))}, "intermediate_size")]:
        r = client.post("/update_weights_from_disk", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["success"] is False and why in r.json()["message"]
        assert ids_of(client) == want_b
    r = client.post("/update_weights_from_disk", json={"model_path": str(ckpt_b), "load_format": "gguf"})
    assert r.status_code == 400 and "load_format" in r.json()["error"]["message"]
    assert client.post("/update_weights_from_disk", json={"model_path": str(ckpt_b),
                                                          "model": "nope"}).status_code == 404
    # And back: the first outputs again
    r = client.post("/update_weights_from_disk", json={"model_path": str(ensure_default_model())})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert ids_of(client) == old


# ---- the offline Engine --------------------------------------------------------------------------
def test_engine_methods(ckpt_b: Path, tmp: Path) -> None:
    from sglang_ext import Engine
    from sglang_ext.sampling.params import InvalidRequest

    with Engine(device="cpu", dtype="float32", max_total_tokens=16384, log_level="warning") as eng:
        ids = eng.tokenize("Hello world")
        assert ids[0] == 0 and eng.detokenize(ids) == "Hello world"  # type: ignore[arg-type]
        assert eng.tokenize(["a", "b c"], add_special_tokens=False) == [eng.tokenize("a", False),
                                                                         eng.tokenize("b c", False)]
        with pytest.raises(InvalidRequest, match="99999"):
            eng.detokenize([99999])
        # profiler
        with pytest.raises(InvalidRequest, match="not running"):
            eng.stop_profile()
        eng.start_profile(output_dir=str(tmp / "eng-prof"))
        old = eng.generate(PROMPT, GREEDY)["output_ids"]  # type: ignore[index]
        eng.stop_profile()
        assert list((tmp / "eng-prof").glob("*.trace.json"))
        # abort by rid from another thread, while this one waits for the result
        timer = threading.Timer(1.0, eng.abort_request, kwargs={"rid": "mine"})
        timer.start()
        res = eng.generate(PROMPT, LONG, rid="mine")
        timer.join()
        assert res["meta_info"]["finish_reason"]["type"] == "abort"  # type: ignore[index]
        # weights
        ok, msg = eng.update_weights_from_disk(str(tmp / "missing"))
        assert not ok and "missing" in msg
        assert eng.generate(PROMPT, GREEDY)["output_ids"] == old  # type: ignore[index]
        ok, msg = eng.update_weights_from_disk(str(ckpt_b))
        assert ok, msg
        assert eng.generate(PROMPT, GREEDY)["output_ids"] != old  # type: ignore[index]
