"""The cluster file's routing keys (router-wide and per model) and `url:` workers: decoded, checked,
and the errors that name what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from router.config import ClusterSpec, ConfigError, build_cluster, load_cluster
from router.routing.settings import RoutingSettings
from sglang_ext.launch import _cluster_from_flags, _serve_parser


def cluster(tmp_path: Path, cfg: dict[str, Any]) -> Any:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_cluster(path)


def test_defaults_keep_the_old_behaviour(tmp_path: Path) -> None:
    c = cluster(tmp_path, {"models": [{"name": "m"}]})
    assert c.routing["m"] == RoutingSettings() and c.routing["m"].policy == "prefix_affinity"
    assert c.upstreams == ()


def test_router_default_and_model_overrides(tmp_path: Path) -> None:
    c = cluster(tmp_path, {
        "router": {"routing": "round_robin", "cache_threshold": 0.3, "balance_abs_threshold": 8},
        "models": [
            {"name": "a"},
            {"name": "b", "routing": "cache_aware", "cache_aware": {"balance_rel_threshold": 2.0,
                                                                      "max_prefix_chars": 100_000}},
            {"name": "c", "routing": "shortest_queue"},
        ]})
    assert c.routing["a"].policy == "round_robin"
    b = c.routing["b"]
    assert (b.policy, b.cache_threshold, b.balance_abs_threshold, b.balance_rel_threshold, b.max_prefix_chars) == (
        "cache_aware", 0.3, 8, 2.0, 100_000)  # the router's, except what the model sets
    assert c.routing["c"].policy == "shortest_queue"


@pytest.mark.parametrize(("cfg", "error"), [
    ({"router": {"routing": "random"}, "models": [{}]}, r"matching regex .*cache_aware.* - at `\$.router.routing`"),
    ({"models": [{"routing": "fastest"}]}, r"at `\$.models\[0\].routing`"),
    ({"models": [{"routing": "cache_aware", "cache_aware": {"cache_threshold": 1.5}}]},
     r"<= 1.0 - at `\$.models\[0\].cache_aware.cache_threshold`"),
    ({"models": [{"routing": "cache_aware", "cache_aware": {"balance_rel_threshold": 0.5}}]},
     r">= 1.0 - at `\$.models\[0\].cache_aware.balance_rel_threshold`"),
    ({"models": [{"routing": "cache_aware", "cache_aware": {"balance_abs_threshold": -1}}]},
     r">= 0 - at `\$.models\[0\].cache_aware.balance_abs_threshold`"),
    ({"models": [{"routing": "cache_aware", "cache_aware": {"max_prefix_chars": 10}}]}, r">= 1024"),
    ({"models": [{"routing": "cache_aware", "cache_aware": {"threshold": 0.5}}]},
     r"unknown field `threshold`"),
    ({"models": [{"name": "x", "routing": "round_robin", "cache_aware": {"cache_threshold": 0.2}}]},
     r"models\[0\].cache_aware: settings of routing cache_aware, but the model routes round_robin"),
])
def test_bad_routing_is_an_error_that_says_where(tmp_path: Path, cfg: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        cluster(tmp_path, cfg)


def test_routing_flags(tmp_path: Path) -> None:
    p = _serve_parser()
    c = _cluster_from_flags(p.parse_args(["--dp-size", "2", "--routing", "cache_aware", "--cache-threshold", "0.25",
                                          "--balance-abs-threshold", "4", "--device", "cpu"]), p)
    s = c.router.routing_defaults
    assert (s.policy, s.cache_threshold, s.balance_abs_threshold) == ("cache_aware", 0.25, 4)
    with pytest.raises(SystemExit):
        _cluster_from_flags(p.parse_args(["--routing", "nope"]), p)


def test_url_workers(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("upstream-secret\n")
    c = cluster(tmp_path, {"models": [{"name": "m", "routing": "cache_aware", "workers": [
        {"url": "http://10.0.0.5:30000/"},
        {"id": "far", "url": "https://gpu.example:8443/api",
         "upstream": {"model": "meta-llama/Llama-3.1-8B", "health_path": "/v1/models", "health_interval_s": 2,
                      "api_key_file": str(key), "context_length": 8192}},
        {"device": "cpu"},
    ]}]})
    assert [w.worker_id for w in c.workers] == ["m-2"]  # only the local one is started
    near, far = c.upstreams
    assert (near.worker_id, near.model, near.url, near.spec.health_path) == ("m-0", "m", "http://10.0.0.5:30000",
                                                                             "/health")
    assert far.url == "https://gpu.example:8443/api" and far.api_key == "upstream-secret"
    assert far.spec.model == "meta-llama/Llama-3.1-8B" and far.spec.context_length == 8192
    assert "upstream-secret" not in repr(far)


@pytest.mark.parametrize(("worker", "error"), [
    ({"url": "10.0.0.5:30000"}, r"workers\[0\].url must look like http://HOST:PORT"),
    ({"url": "ftp://h:1"}, r"must look like http://HOST:PORT"),
    ({"url": "http://h:notaport"}, r"workers\[0\].url 'http://h:notaport'"),
    ({"url": "http://h:1", "device": "cuda:0", "args": {"dtype": "float32"}},
     r"workers\[0\]: device, args configure a worker process started here"),
    ({"url": "http://h:1", "role": "prefill"}, r"role configure a worker process"),
    ({"upstream": {"model": "x"}}, r"workers\[0\].upstream: settings of a `url:` worker, but the worker has no url"),
    ({"url": "http://h:1", "upstream": {"health_path": "health"}}, r"health_path must start with '/'"),
    ({"url": "http://h:1", "upstream": {"health_interval_s": 0}}, r"> 0.0 - at .*health_interval_s"),
    ({"url": "http://h:1", "upstream": {"api_key_file": "/nonexistent/key"}}, r"api_key_file: cannot read it"),
    ({"url": "http://h:1", "upstream": {"api_key_env": "SGLANG_EXT_TEST_UNSET_VAR"}},
     r"upstream.api_key_env: the environment variable SGLANG_EXT_TEST_UNSET_VAR is unset or empty"),
    ({"url": "http://h:1", "upstream": {"api_key_env": "X", "api_key_file": "/k"}},
     r"upstream: give api_key_file or api_key_env, not both"),
    ({"url": "http://h:1", "upstream": {"helth_path": "/x"}}, r"unknown field `helth_path`"),
    ({"url": "http://h:1", "upstream": {"return_token_ids": "yes"}}, r"Expected `bool`.*return_token_ids"),
])
def test_bad_url_worker_is_an_error_that_says_where(tmp_path: Path, worker: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        cluster(tmp_path, {"models": [{"name": "m", "workers": [worker]}]})


def test_the_variables_keys_come_from_are_known(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """So that they can be kept out of the workers' environment (tests/test_worker_secrets.py)."""
    monkeypatch.setenv("UP_KEY", "upstream-secret")
    monkeypatch.setenv("TEAM_KEY", "team-secret")
    c = cluster(tmp_path, {"models": [{"name": "m", "workers": [
        {"url": "http://h:1", "upstream": {"api_key_env": "UP_KEY"}},
        {"url": "http://h:2", "upstream": {"api_key_env": "UP_KEY"}}]}],
        "api_keys": [{"name": "team", "key_env": "TEAM_KEY"}]})
    assert c.key_vars == ("TEAM_KEY", "UP_KEY")
    assert c.upstreams[0].api_key == "upstream-secret" and "upstream-secret" not in repr(c.upstreams[0])


def test_url_worker_ids_are_unique_with_local_ones() -> None:
    spec = msgspec.convert({"models": [{"name": "m", "workers": [{"id": "x"}, {"id": "x", "url": "http://h:1"}]}]},
                           ClusterSpec)
    with pytest.raises(ConfigError, match="unique, repeated: x"):
        build_cluster(spec)


def test_documented_routing_example_parses(tmp_path: Path) -> None:
    import re

    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    section = doc.split("### Routing over replicas", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    path = tmp_path / "c.yaml"
    path.write_text(block.group(1))
    c = load_cluster(path)
    assert c.routing["chat"].policy == "cache_aware" and c.routing["chat"].balance_abs_threshold == 16
    assert c.routing["upstream-chat"].policy == "cache_aware" and c.routing["upstream-chat"].cache_threshold == 0.5
    assert len(c.workers) == 4 and [u.url for u in c.upstreams] == ["http://10.0.0.5:30000", "http://10.0.0.6:8000"]
    assert c.upstreams[1].spec.health_path == "/v1/models"
