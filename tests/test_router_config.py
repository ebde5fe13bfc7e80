"""Cluster file schema (docs/launcher.md's worked example is parsed here) and launcher flag handling."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from router.config import ConfigError, RouterConfig, build_cluster, load_cluster, resolve_api_key
from sglang_ext.env import API_KEY
from sglang_ext.launch import _cluster_from_flags, _serve_parser

DOC = Path(__file__).resolve().parent.parent / "docs" / "launcher.md"


def test_documented_example_parses(tmp_path: Path) -> None:
    block = re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(block.group(1))
    c = load_cluster(cfg)
    assert c.models == ("llama-8b", "qwen-7b", "tiny")
    assert c.router.port == 30000 and c.router.heartbeat_timeout_s == 3.0 and c.router.host == "127.0.0.1"
    by_id = {w.worker_id: w for w in c.workers}
    assert list(by_id) == ["llama-hot-0", "llama-hot-1", "qwen-7b-0", "tiny-0", "tiny-1"]
    hot = by_id["llama-hot-1"]
    assert hot.role == "hot" and hot.model == "llama-8b"
    assert hot.args.device == "cuda:1" and hot.args.mem_fraction_static == 0.55
    assert hot.args.dtype == "bfloat16" and hot.args.chunked_prefill_size == 8192  # the model's args
    assert hot.args.served_model_name == "llama-8b" and hot.args.model_path == "/models/Meta-Llama-3-8B-Instruct"
    assert by_id["qwen-7b-0"].role == "cold" and by_id["qwen-7b-0"].args.max_total_tokens == 200000
    assert by_id["tiny-1"].args.model_path is None and by_id["tiny-1"].args.device == "cpu"
    assert c.slo["llama-8b"].ttft_ms == 1000
    assert by_id["qwen-7b-0"].args.executor_mem_gb == 20
    (o,) = c.offload
    assert (o.from_, o.to, o.policy, o.ratio) == ("llama-8b", "qwen-7b", "fixed", 0.45)


def test_worker_args_override_model_args() -> None:
    import msgspec

    from router.config import ClusterSpec

    spec = msgspec.convert({"models": [{"args": {"device": "cpu", "page_size": 8},
                                        "workers": [{"device": "cuda:3", "args": {"page_size": 32}}, {}]}]},
                           ClusterSpec)
    c = build_cluster(spec)
    assert [(w.worker_id, w.args.device, w.args.page_size) for w in c.workers] == [
        ("default-0", "cuda:3", 32), ("default-1", "cpu", 8)]


def test_duplicate_worker_ids_rejected() -> None:
    import msgspec

    from router.config import ClusterSpec

    spec = msgspec.convert({"models": [{"name": "a", "workers": [{"id": "x"}]},
                                       {"name": "b", "workers": [{"id": "x"}]}]}, ClusterSpec)
    with pytest.raises(ConfigError, match="unique"):
        build_cluster(spec)


def test_flags_make_a_one_model_cluster() -> None:
    p = _serve_parser()
    c = _cluster_from_flags(p.parse_args(["--model-path", "/m/My-Model", "--dp-size", "3", "--api-key", "k",
                                          "--port", "31000", "--max-total-tokens", "4096"]), p)
    assert c.models == ("My-Model",) and [w.worker_id for w in c.workers] == ["My-Model-0", "My-Model-1",
                                                                                "My-Model-2"]
    assert c.router.api_key == "k" and c.router.port == 31000 and c.router.host == "127.0.0.1"
    assert all(w.args.max_total_tokens == 4096 for w in c.workers)
    default = _cluster_from_flags(p.parse_args([]), p)
    assert default.models == ("default",) and default.router.port == 30000 and len(default.workers) == 1


def test_router_flags_come_from_the_settings() -> None:
    p = _serve_parser()
    c = _cluster_from_flags(p.parse_args(["--max-request-mb", "8", "--heartbeat-timeout", "2", "--header-timeout",
                                          "3.5", "--restart-max-fast-crashes", "2", "--worker-port", "31001"]), p)
    r = c.router
    assert (r.max_request_mb, r.heartbeat_timeout_s, r.header_timeout_s, r.restart_max_fast_crashes) == (8, 2, 3.5, 2)
    assert r.max_request_bytes == 8 << 20 and r.worker_port == 31001
    assert r.body_timeout_s == RouterConfig().body_timeout_s  # untouched: the one default
    with pytest.raises(SystemExit):
        _cluster_from_flags(p.parse_args(["--max-request-mb", "0"]), p)  # must be > 0


def test_every_router_setting_has_a_flag_and_is_documented() -> None:
    import msgspec

    from router.config import SERVER_FLAG_FIELDS, flag_name

    help_text = _serve_parser().format_help()
    doc = DOC.read_text()
    for f in msgspec.structs.fields(RouterConfig):
        assert f"  {f.name}:" in doc, f"router.{f.name} is missing from docs/launcher.md's example"
        if f.name not in SERVER_FLAG_FIELDS:
            assert flag_name(f.name) in help_text, f.name


def test_router_section_is_strict(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("router: {max_request_mb: 4, body_timeout_s: 9, max_connections: 100}\nmodels: [{name: a}]")
    c = load_cluster(cfg)
    assert (c.router.max_request_mb, c.router.body_timeout_s, c.router.max_connections) == (4, 9, 100)
    cfg.write_text("router: {max_request_size: 4}\nmodels: [{name: a}]")
    with pytest.raises(ConfigError, match="max_request_size"):
        load_cluster(cfg)
    cfg.write_text("router: {header_timeout_s: -1}\nmodels: [{name: a}]")
    with pytest.raises(ConfigError, match="header_timeout_s"):
        load_cluster(cfg)


def test_api_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _serve_parser()
    key_file = tmp_path / "key"
    key_file.write_text("from-a-file\n")
    monkeypatch.delenv(API_KEY.name, raising=False)
    c = _cluster_from_flags(p.parse_args(["--api-key-file", str(key_file)]), p)
    assert c.router.api_key == "from-a-file"
    assert all(w.args.api_key is None for w in c.workers)
    assert _cluster_from_flags(p.parse_args([]), p).router.api_key is None
    monkeypatch.setenv(API_KEY.name, "from-the-env")
    assert _cluster_from_flags(p.parse_args([]), p).router.api_key == "from-the-env"
    c = _cluster_from_flags(p.parse_args(["--api-key", "from-a-flag"]), p)
    assert c.router.api_key == "from-a-flag" and all(w.args.api_key is None for w in c.workers)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"router: {{api_key_file: {key_file}}}\nmodels: [{{name: a}}]")
    assert _cluster_from_flags(p.parse_args(["--config", str(cfg)]), p).router.api_key == "from-a-file"
    # Mistakes are errors that say what is wrong, never a server without its key.
    with pytest.raises(ConfigError, match="not both"):
        resolve_api_key(RouterConfig(api_key="a", api_key_file=str(key_file)))
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_api_key(RouterConfig(api_key_file=str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        resolve_api_key(RouterConfig(api_key_file=str(tmp_path / "empty")))
    with pytest.raises(SystemExit):
        _cluster_from_flags(p.parse_args(["--api-key-file", str(tmp_path / "missing")]), p)


def test_model_slo_reaches_its_workers_unless_their_args_say_otherwise() -> None:
    import msgspec

    from router.config import ClusterSpec

    spec = msgspec.convert({"models": [
        {"name": "a", "slo": {"ttft_ms": 800, "tpot_ms": 40},
         "workers": [{}, {"args": {"tpot_slo_ms": 25}}]},
        {"name": "b", "slo": {"ttft_ms": 2000}},
        {"name": "c"}]}, ClusterSpec)
    c = build_cluster(spec)
    got = {w.worker_id: (w.args.ttft_slo_ms, w.args.tpot_slo_ms) for w in c.workers}
    assert got == {"a-0": (800, 40), "a-1": (800, 25), "b-0": (2000, None), "c-0": (None, None)}


def test_nonpositive_slo_rejected_with_its_field(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("models:\n  - name: a\n    slo: {ttft_ms: 0}\n")
    with pytest.raises(ConfigError, match="ttft_ms"):
        load_cluster(cfg)


def test_disaggregation_role_is_the_workers_mode() -> None:
    import msgspec

    from router.config import ClusterSpec

    spec = msgspec.convert({"models": [{"workers": [{"role": "prefill"}, {"role": "decode"},
                                                    {"args": {"disaggregation_mode": "decode"}}, {}]}]},
                           ClusterSpec)
    c = build_cluster(spec)
    assert [(w.role, w.args.disaggregation_mode) for w in c.workers] == [
        ("prefill", "prefill"), ("decode", "decode"), ("decode", "decode"), ("serve", None)]
    for bad, match in (({"role": "prefill", "args": {"disaggregation_mode": "decode"}}, "role 'prefill' but"),
                       ({"role": "hot", "args": {"disaggregation_mode": "decode"}}, "role 'hot' cannot"),
                       ({"args": {"disaggregation_mode": "both"}}, "disaggregation_mode must be")):
        with pytest.raises(ConfigError, match=match):
            build_cluster(msgspec.convert({"models": [{"workers": [bad]}]}, ClusterSpec))
