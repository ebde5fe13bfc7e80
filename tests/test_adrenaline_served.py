"""Served Adrenaline placement through `python -m sglang_ext.launch`: the default model has a prefill
worker that offers executor memory and a decode worker, and an `offload:` entry from the model to
itself. A share of the disaggregated requests keep their KV on the prefill worker after prefill (no
KV transfer); its executor runs their decode attention for the decode worker. Model `ref` is the same
embedded model served by one plain worker.

Greedy outputs are `ref`'s, for the requests placed on the executor (meta_info.attention_executor is
the prefill worker) and for the others alike; when the prefill worker is killed while it hosts such
requests, the decode worker recomputes them and they finish unchanged (nothing hangs).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from _router_util import Server, free_port, serve, sse_events, wait_for
from test_disagg_served import ARGS, DECODE_DEVICE, LONG, PROMPTS, generate, pair_state, pd_idle


def cluster(tmp: Any, port: int, entry: dict[str, Any] | None = None) -> str:
    cfg = {"router": {"port": port, "log_level": "info"},
           "models": [{"args": ARGS, "workers": [
               # on a GPU under MPS this bounds the prefill worker's SMs; on the CPU it only shows in its environment
               {"id": "pd-prefill", "role": "prefill", "args": {"executor_mem_gb": 0.05},
                "env": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"}},
               {"id": "pd-decode", "role": "decode", "device": DECODE_DEVICE}]},
               {"name": "ref", "args": ARGS}],
           "offload": [{"from": "default", "to": "default", **(entry or {"policy": "fixed", "ratio": 0.5})}]}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def offload_state(srv: Server) -> dict[str, Any]:
    (p,) = srv.info()["offload"]
    return dict(p)


def placed(srv: Server) -> bool:
    p = offload_state(srv)
    return p["state"] == "active" and (p["from"], p["executor"], p["placement"]) == ("pd-decode", "pd-prefill",
                                                                                     "prefill")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("adrenaline")
    port = free_port()
    with serve(tmp, ["--config", cluster(tmp, port)], workers=3, port=port) as srv:
        wait_for(lambda: pair_state(srv) == "active", 60, "the KV pair opened")
        wait_for(lambda: placed(srv), 60, "pd-decode paired with pd-prefill's executor")
        yield srv


def transfers(srv: Server) -> int:
    return int(srv.worker("pd-prefill")["load"]["kv_transfers_out"])


def settled(srv: Server, what: str) -> int:
    """pd-prefill's KV transfers in a load report made after every request finished."""
    wait_for(lambda: not srv.info()["num_inflight_requests"], 20, what)
    t = time.time()
    wait_for(lambda: srv.worker("pd-prefill")["load"]["timestamp"] > t, 10, f"{what}: a later load report")
    return transfers(srv)


def test_greedy_outputs_equal_a_plain_worker(server: Server) -> None:
    want = generate(server, "ref", PROMPTS, max_new=24)
    for _ in range(2):  # the second time, the prefill worker's prefix cache holds the prompts
        before = settled(server, "nothing in flight")
        got = generate(server, "default", PROMPTS, max_new=24)
        # only the requests not placed on the executor had their KV sent to pd-decode
        assert settled(server, "hand-offs reported") - before == len(PROMPTS) // 2
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        assert [o["text"] for o in got] == [o["text"] for o in want]
        where = [o["meta_info"].get("attention_executor") for o in got]
        # ratio 0.5 of the requests in flight on pd-decode: half of them, placed at prefill
        assert where.count("pd-prefill") == len(PROMPTS) // 2 and where.count(None) == len(PROMPTS) // 2, where
        for o in got:
            m = o["meta_info"]
            assert (m["prefill_worker"], m["decode_worker"]) == ("pd-prefill", "pd-decode")
            assert m["completion_tokens"] == 24
    # Every request done: the executor holds nothing, and neither worker holds a page.

    def idle() -> bool:
        held = sum(server.worker("pd-prefill")["load"]["executor_kv_pairing_tokens"].values())
        return not held and pd_idle(server)

    wait_for(idle, 20, "no executor KV and no page held")
    with server.client() as c:
        metrics = c.get("/metrics").text
    line = 'sglang_ext:disagg_requests_total{event="on_executor",model_name="default"}'
    assert float(next(ln for ln in metrics.splitlines() if ln.startswith(line)).rsplit(" ", 1)[1]) >= len(PROMPTS)
    # The placed requests' KV never went over the KV pair: fewer transfers than requests.
    assert server.worker("pd-decode")["load"]["offloaded_reqs"] == 0


def test_a_worker_gets_its_own_environment(server: Server) -> None:
    def env(worker_id: str) -> list[bytes]:
        with open(f"/proc/{server.worker(worker_id)['info']['pid']}/environ", "rb") as f:
            return f.read().split(b"\0")

    assert b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60" in env("pd-prefill")
    assert not any(v.startswith(b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=") for v in env("pd-decode"))
    assert any(v.startswith(b"PATH=") for v in env("pd-prefill"))  # added to the launcher's, not instead


def test_streaming_placed_request(server: Server) -> None:
    want = generate(server, "ref", LONG, max_new=20)
    body = {"text": [LONG, LONG], "stream": True, "sampling_params": {"max_new_tokens": 20, "temperature": 0,
                                                                      "ignore_eos": True}}
    last: dict[int, Any] = {}
    with server.client() as c, c.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        for e in sse_events(r.iter_lines()):
            last[e["index"]] = e
    assert [last[i]["output_ids"] for i in (0, 1)] == [want["output_ids"]] * 2
    assert {last[i]["meta_info"].get("attention_executor") for i in (0, 1)} == {None, "pd-prefill"}


def test_prefill_worker_killed_while_hosting(server: Server) -> None:
    """Requests whose decode attention runs on the prefill worker's executor when that worker dies are
    recomputed on the decode worker and finish unchanged; nothing hangs."""
    pid = server.worker("pd-prefill")["info"]["pid"]
    preempted = server.worker("pd-decode")["load"]["num_preemptions"]
    want = generate(server, "ref", PROMPTS, max_new=150)
    body = {"text": PROMPTS, "stream": True, "sampling_params": {"max_new_tokens": 150, "temperature": 0,
                                                                 "ignore_eos": True}}
    last: dict[int, Any] = {}
    killed = None
    t0 = time.monotonic()
    with server.client(timeout=60) as c, c.stream("POST", "/generate", json=body) as r:
        for e in sse_events(r.iter_lines()):
            assert "error" not in e, e
            last[e["index"]] = e
            if killed is None and e["meta_info"].get("attention_executor") == "pd-prefill" \
                    and len(e["output_ids"]) > 3:
                os.kill(pid, signal.SIGKILL)  # while this request decodes with its KV on pd-prefill
                killed = len(e["output_ids"])
    assert killed is not None and killed < 150
    # pd-decode lost the executor: the requests there were recomputed (like preempted ones)
    wait_for(lambda: server.worker("pd-decode")["load"]["num_preemptions"] > preempted, 10, "recomputed on pd-decode")
    assert time.monotonic() - t0 < 120
    assert [last[i]["output_ids"] for i in range(len(PROMPTS))] == [o["output_ids"] for o in want]
    # The launcher restarts it; the router pairs both again and places requests there again.
    wait_for(lambda: (w := server.worker("pd-prefill"))["up"] and w["info"]["pid"] != pid, 60, "pd-prefill restarted")
    wait_for(lambda: pair_state(server) == "active" and placed(server), 60, "pd-prefill paired again")
    got = generate(server, "default", PROMPTS[:2])
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in generate(server, "ref", PROMPTS[:2])]
    assert "pd-prefill" in {o["meta_info"].get("attention_executor") for o in got}


def test_decode_worker_killed_while_its_requests_are_on_the_executor(server: Server) -> None:
    """The decode worker dies while some of its requests run on pd-prefill's executor: their streams
    end with an explicit 503 at once, and the executor gives their KV back (the pairing ended)."""
    pid = server.worker("pd-decode")["info"]["pid"]
    body = {"text": PROMPTS[:4], "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    ends: dict[int, Any] = {}
    seen_remote = False
    t0 = time.monotonic()
    with server.client(timeout=30) as c, c.stream("POST", "/generate", json=body) as r:
        for e in sse_events(r.iter_lines()):
            if "error" in e:
                ends[e.get("index", -1)] = e
                continue
            if not seen_remote and e["meta_info"].get("attention_executor") == "pd-prefill" \
                    and len(e["output_ids"]) > 3:
                seen_remote = True
                os.kill(pid, signal.SIGKILL)
    assert seen_remote and time.monotonic() - t0 < 30
    assert ends and all(e["error"]["code"] == 503 for e in ends.values()), ends
    wait_for(lambda: not sum(server.worker("pd-prefill")["load"]["executor_kv_pairing_tokens"].values()), 20,
             "pd-prefill's executor released the dead sender's KV")
    wait_for(lambda: (w := server.worker("pd-decode"))["up"] and w["info"]["pid"] != pid, 60, "pd-decode restarted")
    wait_for(lambda: pair_state(server) == "active" and placed(server), 60, "pd-decode paired again")
    got = generate(server, "default", PROMPTS[:2])
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in generate(server, "ref", PROMPTS[:2])]


@pytest.mark.parametrize("entry", [{"policy": "adrenaline", "max_ratio": 0.5},
                                   {"policy": "adaptive", "ratio": 0.5, "max_ratio": 0.8,
                                    "adaptive": {"min_context_tokens": 0}}])  # short prompts: no break-even
def test_planned_policies(tmp_path: Any, entry: dict[str, Any]) -> None:
    """The planned policies decide the share of an Adrenaline pairing like any other's: outputs are
    unchanged, and the requests placed on the executor stay within the policy's cap."""
    port = free_port()
    path = cluster(tmp_path, port, entry)
    if entry["policy"] == "adaptive":  # its controller keeps the model's P99 TPOT within an SLO
        with open(path) as f:
            cfg = yaml.safe_load(f)
        cfg["models"][0]["slo"] = {"tpot_ms": 10000}
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
    with serve(tmp_path, ["--config", path], workers=3, port=port) as srv:
        wait_for(lambda: pair_state(srv) == "active" and placed(srv), 60, "paired")
        want = generate(srv, "ref", PROMPTS, max_new=12)
        got = generate(srv, "default", PROMPTS, max_new=12)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        p = offload_state(srv)
        assert p["policy"] == entry["policy"] and 0 <= p["ratio"] <= entry["max_ratio"]
        # the share moves with the decode worker's batch; it never passes max_ratio
        n = sum(o["meta_info"].get("attention_executor") == "pd-prefill" for o in got)
        assert n <= entry["max_ratio"] * len(PROMPTS) + 1e-9, (n, p)
