"""cache_aware served: two replicas of the embedded model (`--dp-size 2 --routing cache_aware`); requests
that share a prompt prefix land on one replica, whose prefix cache then serves that prefix."""

from __future__ import annotations

from pathlib import Path

import httpx
from _router_util import SMALL, Server, serve

WEATHER = "You are a meticulous assistant who answers questions about the weather in short sentences. " * 6
PASTA = "Another system prompt entirely: a chef explains how to cook pasta, step by step, with care. " * 6


def served(srv: Server) -> dict[str, int]:
    return {w["worker_id"]: w["num_served"] for w in srv.info()["models"]["default"]["workers"]}


def ask(c: httpx.Client, srv: Server, text: str) -> tuple[str, float]:
    """The replica that served `text`, and the share of its prompt tokens that replica's cache held."""
    before = served(srv)
    r = c.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert r.status_code == 200, r.text
    after = served(srv)
    (worker,) = [w for w in after if after[w] > before[w]]
    meta = r.json()["meta_info"]
    return worker, meta["cached_tokens"] / meta["prompt_tokens"]


def test_shared_prefixes_stick_to_one_replica(tmp_path: Path) -> None:
    with serve(tmp_path, ["--dp-size", "2", "--routing", "cache_aware", *SMALL], workers=2) as srv, \
            srv.client() as c:
        first, cached = ask(c, srv, WEATHER + "Is it raining in Paris?")
        assert cached == 0
        for city in ("Rome", "Oslo", "Lima"):
            worker, cached = ask(c, srv, WEATHER + f"Is it raining in {city}?")
            assert worker == first
            assert cached > 0.8  # the shared prefix came from that replica's cache
        other, _ = ask(c, srv, PASTA + "How long do I boil penne?")
        assert other != first  # a new prefix goes to the idle, emptier replica ...
        worker, cached = ask(c, srv, PASTA + "How long do I boil fusilli?")
        assert worker == other and cached > 0.8  # ... and its family follows it there
        decisions = srv.info()["routing"]["default"]["decisions"]
        assert decisions == {"prefix": 4, "balance": 0, "cold": 2}
