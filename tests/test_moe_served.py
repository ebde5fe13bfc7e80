"""An MoE model served through `python -m sglang_ext.launch` with both mechanisms that move attention:
a small Mixtral checkpoint (4 experts, top-2, written by transformers) as model `moe-pd` with a
prefill and a decode worker (PD over gloo), as model `moe-hot` sending half of its decoding requests'
attention and KV to an executor on the worker of dense model `cold` (WEAVER's pairing), and as model
`moe-ref`, one plain worker. Greedy outputs of both equal `moe-ref`'s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from _moe_ckpt import write_mixtral
from _router_util import Server, free_port, serve, wait_for

from sglang_ext.models.default_model import ensure_default_model

transformers = pytest.importorskip("transformers")

ARGS = {"max_total_tokens": 8192, "dtype": "float32", "device": "cpu", "log_level": "warning"}
PROMPTS = ["The weather today is", "Once upon a time,", "A list of fruits: apples, pears, plums, cherries, grapes",
           "Hi", "Numbers: 1, 2, 3,", "Dear team,"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("moe")
    moe = tmp / "mixtral"
    write_mixtral(moe)
    cold = tmp / "cold"
    cold.mkdir()
    (cold / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096, "vocab_size": 2048,
        "eos_token_id": 1, "bos_token_id": 0, "torch_dtype": "float32"}))
    tok = str(ensure_default_model())
    port = free_port()
    moe_args = {**ARGS, "tokenizer_path": tok}
    cfg = {
        "router": {"port": port, "log_level": "info"},
        "models": [
            {"name": "moe-pd", "model_path": str(moe), "args": moe_args,
             "workers": [{"id": "pd-prefill", "role": "prefill"}, {"id": "pd-decode", "role": "decode"}]},
            {"name": "moe-hot", "model_path": str(moe), "args": moe_args},
            {"name": "moe-ref", "model_path": str(moe), "args": moe_args},
            {"name": "cold", "model_path": str(cold),
             "args": {**ARGS, "load_format": "dummy", "tokenizer_path": tok, "max_total_tokens": 2048,
                      "executor_mem_gb": 0.05}},
        ],
        "offload": [{"from": "moe-hot", "to": "cold", "policy": "fixed", "ratio": 0.5}],
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with serve(tmp, ["--config", str(path)], workers=5, port=port) as srv:
        wait_for(lambda: srv.info()["offload"][0]["state"] == "active", 90, "moe-hot paired with cold")
        wait_for(lambda: srv.info()["disaggregation"][0]["state"] == "active", 90, "the PD pair opened")
        yield srv


def generate(srv: Server, model: str, max_new: int = 24) -> list[dict[str, Any]]:
    with srv.client(timeout=180) as c:
        r = c.post("/generate", json={"text": PROMPTS, "model": model, "sampling_params": {
            "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return list(r.json())


def test_moe_remote_attention_and_pd_equal_a_plain_worker(server: Server) -> None:
    ref = [o["output_ids"] for o in generate(server, "moe-ref")]
    assert len({tuple(o) for o in ref}) > 1  # a real model: prompts give different continuations
    hot = generate(server, "moe-hot")
    assert [o["output_ids"] for o in hot] == ref
    assert any(o["meta_info"].get("attention_executor") for o in hot)  # the share really moved
    assert [o["output_ids"] for o in generate(server, "moe-pd")] == ref
