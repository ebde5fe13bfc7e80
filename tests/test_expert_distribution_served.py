"""POST /start_expert_distribution_record, /stop_... and /dump_... against a real launcher (CPU) serving a
tiny Mixtral on dummy weights with --expert-distribution-recorder-mode stat (`moe`), the same model without
it (`moe-off`) and the embedded dense model (`dense`); the offline Engine's methods of the same names; and
the router's fan-out over two fake workers, one of which refuses."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
import zmq.asyncio
from _router_util import FakeWorker, Server, free_port, serve, until

from router.api.app import build_app
from router.config import RouterConfig
from router.core import Router
from sglang_ext.messages import ExpertDistributionReq, ReplyOut
from sglang_ext.models.default_model import VOCAB_SIZE, ensure_default_model

KEY = "experts-key"
ARGS = {"max_total_tokens": 4096, "dtype": "float32", "device": "cpu", "log_level": "warning"}
EXPERTS, TOP_K, LAYERS = 8, 2, 2
PROMPTS = ["The weather today is", "Once upon a time,", "Numbers: 1, 2, 3,"]


def tiny_mixtral(d: Path) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K, "max_position_embeddings": 1024,
        "vocab_size": VOCAB_SIZE, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32"}))
    return d


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("experts")


@pytest.fixture(scope="module")
def server(tmp: Path) -> Iterator[Server]:
    moe = str(tiny_mixtral(tmp / "mixtral"))
    tok = str(ensure_default_model())
    moe_args = {**ARGS, "load_format": "dummy", "tokenizer_path": tok}
    port = free_port()
    cfg = {
        "router": {"port": port, "api_key": KEY, "log_level": "warning"},
        "models": [
            {"name": "moe", "model_path": moe, "args": {**moe_args, "expert_distribution_recorder_mode": "stat"}},
            {"name": "moe-off", "model_path": moe, "args": moe_args},
            {"name": "dense", "args": ARGS},
        ],
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with serve(tmp, ["--config", str(path)], workers=3, api_key=KEY, port=port) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def post(c: httpx.Client, what: str, **body: Any) -> httpx.Response:
    return c.post(f"/{what}_expert_distribution_record", json={"model": "moe", **body})


def generate(c: httpx.Client, max_new: int) -> int:
    """Tokens the model ran for these requests: each prompt, and every output token but the last."""
    r = c.post("/generate", json={"text": PROMPTS, "model": "moe", "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return sum(o["meta_info"]["prompt_tokens"] + o["meta_info"]["completion_tokens"] - 1 for o in r.json())


def test_record_the_tokens_between_start_and_stop(client: httpx.Client, tmp: Path) -> None:
    generate(client, 3)  # before the start: not recorded
    r = post(client, "start")
    assert r.status_code == 200, r.text
    assert r.json()["message"] == "Started recording the expert distribution of model 'moe' on 1 worker(s)."
    assert list(r.json()["workers"]) == ["moe-0"]
    tokens = generate(client, 6)
    assert post(client, "stop").status_code == 200
    generate(client, 2)  # after the stop: not recorded either
    out = tmp / "dumps"
    r = post(client, "dump", output_dir=str(out))
    assert r.status_code == 200, r.text
    files = r.json()["files"]
    assert r.json()["workers"]["moe-0"]["files"] == files and len(files) == 2
    pt, js = map(Path, files)
    assert pt.parent == out and pt.name.startswith("expert_distribution_recorder_moe-0_") and pt.suffix == ".pt"
    data = torch.load(pt)
    count = data["logical_count"]
    assert count.dtype == torch.int64 and count.shape == (LAYERS, EXPERTS)
    assert count.sum(dim=1).tolist() == [tokens * TOP_K] * LAYERS  # every token of the window, in every layer
    assert data["tokens"] == tokens and data["layers"] == [0, 1] and data["top_k"] == TOP_K
    assert data["model"] == "moe" and data["worker"] == "moe-0"
    assert json.loads(js.read_text())["logical_count"] == count.tolist()


def test_the_errors(server: Server, client: httpx.Client) -> None:
    r = client.post("/start_expert_distribution_record", json={"model": "dense"})
    assert r.status_code == 400 and "model 'dense' has no MoE layers" in r.json()["error"]["message"]
    r = client.post("/start_expert_distribution_record", json={"model": "moe-off"})
    assert r.status_code == 400
    assert "start it with --expert-distribution-recorder-mode stat" in r.json()["error"]["message"]
    r = post(client, "stop")
    assert r.status_code == 400 and "not being recorded" in r.json()["error"]["message"]
    r = post(client, "start", output_dir="/proc/no/such")
    assert r.status_code == 400 and "output_dir" in r.json()["error"]["message"]
    r = post(client, "start", model="nope")
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = post(client, "start", bogus=1)
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
    r = client.post("/start_expert_distribution_record")  # no body: the default model (the first, `moe`)
    assert r.status_code == 200 and "of model 'moe'" in r.json()["message"], r.text
    assert client.post("/stop_expert_distribution_record").status_code == 200
    with httpx.Client(base_url=server.url) as anon:  # the router's API key, as everywhere
        assert anon.post("/start_expert_distribution_record", json={"model": "moe"}).status_code == 401


def test_engine_methods(tmp: Path) -> None:
    from sglang_ext import Engine
    from sglang_ext.sampling.params import InvalidRequest

    with Engine(model_path=str(tmp / "mixtral"), tokenizer_path=str(ensure_default_model()),
                expert_distribution_recorder_mode="stat", **{**ARGS, "load_format": "dummy"}) as eng:
        with pytest.raises(InvalidRequest, match="not being recorded"):
            eng.stop_expert_distribution_record()
        eng.start_expert_distribution_record()
        out = eng.generate(PROMPTS[0], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        eng.stop_expert_distribution_record()
        files = eng.dump_expert_distribution_record(output_dir=str(tmp / "engine"))
        meta = out["meta_info"]  # type: ignore[call-overload]
        assert torch.load(files[0])["tokens"] == meta["prompt_tokens"] + 3


async def test_the_router_fans_out_and_names_the_worker_that_refused(ctx: zmq.asyncio.Context) -> None:
    router = Router(RouterConfig())
    await router.start()
    workers = [FakeWorker(ctx, router.worker_addr, f"w{i}", "m") for i in range(2)]
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router)), base_url="http://router")

    async def ask(what: str, answers: list[dict[str, Any]], **body: Any) -> httpx.Response:
        task = asyncio.create_task(client.post(f"/{what}_expert_distribution_record", json=body))
        for w, data in zip(workers, answers, strict=True):
            msg = await w.recv()
            assert isinstance(msg, ExpertDistributionReq) and msg.action == what
            assert msg.output_dir == body.get("output_dir", "")
            await w.send(ReplyOut(rid=msg.rid, ok="error" not in data, data=data))
        return await task

    try:
        for w in workers:
            await w.hello()
        await until(lambda: sum(x.up for x in router.registry.workers.values()) == 2)
        ok = {"message": "fine", "files": []}
        r = await ask("start", [ok, {"error": "w1: not writable", "status": 400}], output_dir="/x")
        assert r.status_code == 400 and r.json()["error"]["message"] == "w1: not writable (done on w0)"
        r = await ask("dump", [{"message": "a", "files": ["/d/a.pt", "/d/a.json"]},
                               {"message": "b", "files": ["/d/b.pt", "/d/b.json"]}], model="m")
        assert r.status_code == 200 and r.json()["files"] == ["/d/a.pt", "/d/a.json", "/d/b.pt", "/d/b.json"]
        assert r.json()["workers"]["w1"] == {"message": "b", "files": ["/d/b.pt", "/d/b.json"]}
    finally:
        await client.aclose()
        for w in workers:
            w.close()
        await router.stop()


def test_bench_expert_record_runs_a_workload_between_start_and_stop(server: Server, tmp: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """bench/expert_record.py: start, bench/serving.py's workload, stop, dump, and the skew it reads."""
    from bench import expert_record

    out = tmp / "record"
    rc = expert_record.main(["--out", str(out), "--model", "moe", "--", "--base-url", server.url,
                             "--api-key", KEY, "--models", "moe", "--num-requests", "4", "--request-rate", "inf",
                             "--synthetic-input-len", "12", "--synthetic-output-len", "3",
                             "--vocab-size", str(VOCAB_SIZE), "--disable-tqdm"])
    assert rc == 0
    report = json.loads((out / "serving.json").read_text())
    assert report["metrics"]["completed"] == 4
    skew = json.loads((out / "skew.json").read_text())
    (w,) = skew["per_worker"]
    assert (w["layers"], w["num_experts"], w["top_k"]) == (LAYERS, EXPERTS, TOP_K)
    # the workload's tokens, plus the serving bench's warm-up request: at least 4 x (12 + 2)
    assert w["tokens"] >= 4 * (12 + 2)
    hit = w["experts_hit"]
    assert hit["1"]["recorded"] == pytest.approx(TOP_K) and hit["1"]["uniform"] == pytest.approx(TOP_K)
    assert TOP_K <= hit["8"]["recorded"] <= EXPERTS and all(TOP_K / EXPERTS <= s <= 1 for s in w["top_k_share"])
    assert "experts hit a layer under this record" in capsys.readouterr().out


def test_bench_expert_record_stops_before_the_workload_when_the_server_cannot_record(
        server: Server, tmp: Path) -> None:
    """A model served without --expert-distribution-recorder-mode: the start is refused with the server's
    reason, and no workload is sent (nothing to record, no serving.json)."""
    from bench import expert_record

    out = tmp / "refused"
    with pytest.raises(SystemExit, match=r"start_expert_distribution_record: HTTP 400: .*"
                                         r"--expert-distribution-recorder-mode stat"):
        expert_record.main(["--out", str(out), "--model", "moe-off", "--", "--base-url", server.url,
                            "--api-key", KEY, "--models", "moe-off", "--num-requests", "2", "--disable-tqdm"])
    assert not (out / "serving.json").exists()
