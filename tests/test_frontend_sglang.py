"""SGLang frontend programs (`@sgl.function`, gen, select, fork, stream, run_batch, constrained gen) run unchanged
against the router through `sgl.RuntimeEndpoint` (see tests/frontend/)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from _router_util import ROOT, SMALL, Server, serve

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="the sglang frontend is not installed (scripts/setup.sh installs it)")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("frontend"), SMALL) as srv:
        yield srv


@pytest.fixture(scope="module")
def result(server: Server) -> dict:
    p = subprocess.run([sys.executable, "tests/frontend/programs.py", server.url],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return json.loads(lines[-1][len("RESULT "):])


def _generate(server: Server, text: str, **sp: object) -> dict:
    r = httpx.post(server.url + "/generate", json={"text": text, "sampling_params": {"temperature": 0, **sp}})
    r.raise_for_status()
    return r.json()


def test_gen_with_stop_and_max_tokens(server: Server, result: dict) -> None:
    assert result["model_name"] == "default"
    prompt = "Q: What is one plus one?\nA:"
    expected = _generate(server, prompt, max_new_tokens=12, stop=["\n"])["text"]
    assert result["qa"]["answer"] == expected and "\n" not in expected
    assert result["qa"]["text"] == prompt + expected
    assert result["qa"]["meta"]["completion_tokens"] <= 12
    assert result["capped"] == _generate(server, "Once upon a time", max_new_tokens=6)["text"]


def test_stream(server: Server, result: dict) -> None:
    assert "".join(result["stream_pieces"]) == result["stream_final"]
    assert result["stream_final"] == _generate(server, "Q: Say something.\nA:", max_new_tokens=12,
                                               stop=["\n"])["text"]


def test_run_batch(result: dict) -> None:
    assert len(result["batch"]) == 3 and result["batch"][2] == result["qa"]["answer"]


def test_select(server: Server, result: dict) -> None:
    choices = [" red", " blue", " green"]
    assert result["select"] in choices
    # The frontend picks by normalized prompt logprob; recompute it from /generate.
    r = httpx.post(server.url + "/generate", json={
        "text": ["My favourite colour is" + c for c in choices], "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0}}).json()
    prompt_len = _generate(server, "My favourite colour is", max_new_tokens=0)["meta_info"]["prompt_tokens"]

    def score(o: dict) -> float:
        lps = [e[0] for e in o["meta_info"]["input_token_logprobs"][max(prompt_len - 2, 0):] if e[0] is not None]
        return sum(lps) / len(lps)

    assert result["select"] == max(zip(choices, r, strict=True), key=lambda cr: score(cr[1]))[0]


def test_fork(result: dict) -> None:
    text = result["fork"]["text"]
    assert text.startswith("List two things.\nFirst:") and "\nSecond:" in text


def test_chat_and_server_calls(result: dict) -> None:
    assert isinstance(result["chat"], str) and result["server_info_ok"] is True


def test_constrained_gen(result: dict) -> None:
    """gen(regex=...), gen(json_schema=...), gen_int and select in one program, unchanged."""
    import re

    out = result["structured"]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out["phone"]), out
    assert out["answer"] in ("yes", "no")
    person = json.loads(out["person"])
    assert set(person) == {"name", "age"} and re.fullmatch("[a-z]{1,8}", person["name"]) and 0 <= person["age"] <= 120
    assert re.fullmatch(r"[-+]?[0-9]+", out["age"]), out  # gen_int: the frontend's integer regex, stop at " "
    assert out["mood"] in (" happy", " sad")
    assert f"Phone number: {out['phone']}" in out["text"] and out["person"] in out["text"]
