"""Served prefill/decode disaggregation when a worker dies mid-stream (SIGKILL), one at a time: the
decode worker (its streams end with an explicit 503 at once, never hang) and the prefill worker (the
requests it handed off already finish on the decode worker, unchanged). Meanwhile the model is served
by whatever is up, whole requests on one worker; the launcher restarts the killed worker, the router
pairs it again and requests are disaggregated again.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _router_util import ROOT, Server, free_port, serve, sse_events, wait_for
from test_disagg_served import LONG, PROMPTS, cluster, generate, pair_state

HOOKS = ROOT / "tests" / "hooks"


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """While this file exists, pd-prefill holds in the middle of a prefill (tests/hooks/prefill_gate)."""
    return tmp_path_factory.mktemp("gate") / "prefill-gate"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, gate: Path) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("disagg-fail")
    port = free_port()
    # The hook first, then the repository (the hook imports the worker before `-m` puts the working
    # directory on the path; an installed copy elsewhere must not win), then whatever was there.
    path = os.pathsep.join([str(HOOKS / "prefill_gate"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {"SGLANG_EXT_TEST_PREFILL_GATE": str(gate), "PYTHONPATH": path}
    # Small prefill chunks: a long prompt stays in prefill over many steps (to kill its worker there).
    with serve(tmp, ["--config", cluster(tmp, port, {"chunked_prefill_size": 32}, env)], workers=3, port=port) as srv:
        wait_for(lambda: pair_state(srv) == "active", 60, "the KV pair opened")
        yield srv


def kill(srv: Server, worker_id: str) -> None:
    os.kill(srv.worker(worker_id)["info"]["pid"], signal.SIGKILL)


def disaggregated_again(srv: Server, worker_id: str, pid: int) -> None:
    wait_for(lambda: (w := srv.worker(worker_id))["up"] and w["info"]["pid"] != pid, 60, f"{worker_id} restarted")
    wait_for(lambda: pair_state(srv) == "active", 30, "the KV pair opened again")
    want = generate(srv, "ref", PROMPTS[:3])
    got = generate(srv, "default", PROMPTS[:3])
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert {o["meta_info"]["decode_worker"] for o in got} == {"pd-decode"}


def test_decode_worker_killed_mid_stream(server: Server) -> None:
    pid = server.worker("pd-decode")["info"]["pid"]
    body = {"text": PROMPTS[1], "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    t0 = time.monotonic()
    with server.client(timeout=30) as c, c.stream("POST", "/generate", json=body) as r:
        events = sse_events(r.iter_lines())
        for _ in range(3):
            assert next(events)["meta_info"]["decode_worker"] == "pd-decode"
        kill(server, "pd-decode")
        rest = list(events)
    assert time.monotonic() - t0 < 20
    assert rest and "error" in rest[-1], rest[-1:]
    assert rest[-1]["error"]["code"] == 503 and "pd-decode" in rest[-1]["error"]["message"]
    # The prefill worker serves the model whole while the decode worker is away.
    wait_for(lambda: not server.worker("pd-decode")["up"], 10, "pd-decode marked down")
    one = generate(server, "default", PROMPTS[0])
    assert one["output_ids"] == generate(server, "ref", PROMPTS[0])["output_ids"]
    if "decode_worker" not in one["meta_info"]:  # (it may have come back already)
        assert "prefill_worker" not in one["meta_info"]
    disaggregated_again(server, "pd-decode", pid)


def test_prefill_worker_killed_mid_stream(server: Server) -> None:
    """Requests already handed off keep decoding (their KV is on the decode worker); those still in
    prefill are retried; every output is unchanged."""
    pid = server.worker("pd-prefill")["info"]["pid"]
    want = generate(server, "ref", PROMPTS, max_new=120)
    body = {"text": PROMPTS, "stream": True, "sampling_params": {"max_new_tokens": 120, "temperature": 0,
                                                                 "ignore_eos": True}}
    last: dict[int, Any] = {}
    killed = None
    with server.client(timeout=60) as c, c.stream("POST", "/generate", json=body) as r:
        for e in sse_events(r.iter_lines()):
            assert "error" not in e, e
            last[e["index"]] = e
            if killed is None and e["meta_info"].get("decode_worker"):
                kill(server, "pd-prefill")  # while this request decodes on pd-decode
                killed = len(e["output_ids"])
    assert killed is not None and killed < 120
    assert [last[i]["output_ids"] for i in range(len(PROMPTS))] == [o["output_ids"] for o in want]
    # Each was handed off before the kill (and finished on pd-decode), or was still in prefill there
    # (small chunks) and was retried from the start, whole on pd-decode.
    for e in last.values():
        m = e["meta_info"]
        assert (m.get("prefill_worker"), m.get("decode_worker")) == ("pd-prefill", "pd-decode") or \
            (m["id"].endswith("+retry1") and "prefill_worker" not in m), m
    one = generate(server, "default", PROMPTS[3])  # served, by pd-decode alone or by the new pair
    assert one["output_ids"] == generate(server, "ref", PROMPTS[3])["output_ids"]
    disaggregated_again(server, "pd-prefill", pid)


def test_prefill_worker_killed_before_the_first_token(server: Server, gate: Path) -> None:
    """A request still in prefill is retried from the start, on the decode worker (served whole), and
    its output is unchanged; the client sees one normal response.

    The prefill worker is held in the middle of the prompt's prefill (the gate, tests/hooks/prefill_gate)
    until it is killed: a fast host prefills the whole prompt before a load report (every 0.5 s) could
    show it running, so racing it killed the worker after its first token 2 times in 3 on an H200 host."""
    prompt = " ".join([LONG] * 50)  # ~1800 tokens: ~60 prefill steps of 32 tokens
    want = generate(server, "ref", prompt, max_new=8)
    held = gate.with_name(gate.name + ".held")
    held.unlink(missing_ok=True)
    gate.touch()
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(generate(server, "default", prompt, max_new=8)))
    t.start()
    try:
        wait_for(held.exists, 60, "pd-prefill holding the prompt in prefill", poll=0.02)
        # Held there: its load reports go on and show the prompt running, however fast the host.
        wait_for(lambda: server.worker("pd-prefill").get("load", {}).get("num_running"), 30,
                 "the prompt in prefill on pd-prefill", poll=0.02)
        kill(server, "pd-prefill")
    finally:
        gate.unlink(missing_ok=True)  # before its restart: the new process must not hold
        t.join(60)
    assert not t.is_alive() and result, server.log()[-4000:]
    out = result[0]
    assert out["output_ids"] == want["output_ids"]
    assert out["meta_info"]["id"].endswith("+retry1"), (out["meta_info"], server.log()[-3000:])
    assert "prefill_worker" not in out["meta_info"]  # served whole by pd-decode
    # (pairing again after a restart is checked above; here the worker left standing keeps serving)
    assert generate(server, "default", PROMPTS[0])["output_ids"] == generate(server, "ref", PROMPTS[0])["output_ids"]
