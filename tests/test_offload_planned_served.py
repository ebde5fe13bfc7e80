"""Served WEAVER pairings under the planned policies, through `python -m sglang_ext.launch`: model
`hot-a` offloads to `cold`'s executor under `adrenaline`, `hot-b` under `adaptive` (both the
embedded model, both hosted by the one cold worker); `ref` is the same model without offload.
Greedy outputs of both senders equal `ref`'s, some of their requests decoding on the executor,
while the planner's decisions reach the senders live (their load reports say the ratio and bound
in force) and show in /get_server_info and /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from _router_util import Server, free_port, serve, wait_for
from test_offload_served import ARGS, COLD_DEVICE, generate

from sglang_ext.models.default_model import ensure_default_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("planned")
    cold = tmp / "cold"  # a small Llama of another geometry, as in test_offload_served
    cold.mkdir()
    (cold / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096, "vocab_size": 2048,
        "eos_token_id": 1, "bos_token_id": 0, "torch_dtype": "float32"}))
    port = free_port()
    cfg = {
        "router": {"port": port, "log_level": "info"},
        "models": [
            {"name": "hot-a", "args": ARGS},
            {"name": "hot-b", "args": ARGS},
            {"name": "ref", "args": ARGS},
            {"name": "cold", "model_path": str(cold), "slo": {"tpot_ms": 10_000},
             "args": {**ARGS, "device": COLD_DEVICE, "load_format": "dummy",
                      "tokenizer_path": str(ensure_default_model()), "max_total_tokens": 2048,
                      "executor_mem_gb": 0.05}},
        ],
        "offload": [
            {"from": "hot-a", "to": "cold", "policy": "adrenaline", "adrenaline": {"bandwidth_share": 1.0}},
            # min_context_tokens 0: these prompts are a few tokens, under any break-even context
            {"from": "hot-b", "to": "cold", "policy": "adaptive", "ratio": 0.3,
             "adaptive": {"interval_s": 0.3, "step_up": 0.1, "min_context_tokens": 0}},
        ],
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with serve(tmp, ["--config", str(path)], workers=4, port=port) as srv:
        wait_for(lambda: {p["state"] for p in srv.info()["offload"]} == {"active"}, 60, "both senders paired")
        yield srv


def pairing(srv: Server, sender: str) -> dict[str, Any]:
    (p,) = [p for p in srv.info()["offload"] if p["from"] == sender]
    return dict(p)


def test_adrenaline_outputs_equal_without_offload(server: Server) -> None:
    # the host's first load report gives the executor's KV: a positive bound, sent to the sender
    p = wait_for(lambda: (p := pairing(server, "hot-a-0"))["ob"] and p, 10, "a positive OB")
    assert p["policy"] == "adrenaline" and p["executor"] == "cold-0" and p["why"].startswith("OB ")
    load = wait_for(lambda: (w := server.worker("hot-a-0")["load"])["offload_bound"] > 0 and w, 10,
                    "the bound in force on the sender")
    assert load["offload_ratio"] == 1.0  # the cap; C1/C2 decide per request
    want = [o["output_ids"] for o in generate(server, "ref", 24)]
    outs = generate(server, "hot-a", 24)
    assert [o["output_ids"] for o in outs] == want
    where = {o["meta_info"]["attention_executor"] for o in outs}
    assert "cold-0" in where and None in where, where  # C1/C2 keep the first requests local


def test_adaptive_outputs_equal_without_offload_and_its_ratio_moves(server: Server) -> None:
    want = [o["output_ids"] for o in generate(server, "ref", 24)]
    outs = generate(server, "hot-b", 24)
    assert [o["output_ids"] for o in outs] == want
    assert "cold-0" in {o["meta_info"]["attention_executor"] for o in outs}
    # cold serves nothing, so it has slack: the share rose while hot-b had requests, and the sender
    # follows the planner's latest decision. The planner may look again after the last request ended
    # (the sender then has nothing to send): it holds the share, and says so.
    p = pairing(server, "hot-b-0")
    held = ("raised", "at max_ratio", "slack (")  # "slack (...), the sender has nothing to send"
    assert p["updates"] > 0 and p["ratio"] > 0.3 and p["why"].startswith(held), p
    wait_for(lambda: server.worker("hot-b-0")["load"]["offload_ratio"] == pairing(server, "hot-b-0")["ratio"], 10,
             "the sender's ratio in force is the planner's")
    with server.client() as c:
        text = c.get("/metrics").text
    names = ("sglang_ext:offload_ratio{", "sglang_ext:offload_bound{")
    gauges = [ln for ln in text.splitlines() if ln.startswith(names)]
    assert any('policy="adaptive"' in ln and 'worker="hot-b-0"' in ln for ln in gauges), gauges
    assert any('policy="adrenaline"' in ln and 'worker="hot-a-0"' in ln for ln in gauges), gauges
