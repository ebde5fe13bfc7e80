"""The environment variables sglang_ext reads (`sglang_ext/env.py`) and where docs/configuration.md lists
them and every server argument."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sglang_ext import env
from sglang_ext.configs import cache_root
from sglang_ext.server_args import ServerArgs

DOC = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()


def test_a_variable_is_read_when_asked_and_empty_is_unset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(env.CACHE.name, raising=False)
    assert env.CACHE.get() is None and cache_root() == Path.home() / ".cache" / "sglang_ext"
    monkeypatch.setenv(env.CACHE.name, str(tmp_path))
    assert env.CACHE.get() == tmp_path and cache_root() == tmp_path
    monkeypatch.setenv(env.CACHE.name, "~/x")
    assert env.CACHE.get() == Path.home() / "x"
    monkeypatch.setenv(env.CACHE.name, "")
    assert env.CACHE.get() is None
    assert env.API_KEY.get({env.API_KEY.name: "k"}) == "k" and env.API_KEY.get({}) is None


def test_the_docs_list_every_variable_and_every_server_argument() -> None:
    for var in env.ALL:
        assert f"| `{var.name}` |" in DOC, var.name
        assert var.help and (var.name.startswith("SGLANG_EXT_") or var.sglang_name)
    missing = [f.name for f in dataclasses.fields(ServerArgs) if f"`{f.name}`" not in DOC]
    assert not missing, f"server arguments missing from docs/configuration.md: {missing}"


def test_no_other_module_reads_the_environment() -> None:
    """Outside env.py (and the remote-attention and disaggregation data planes' own switches) nothing in
    the package reads an environment variable: behaviour comes from server arguments."""
    root = Path(__file__).resolve().parent.parent
    readers = [str(p.relative_to(root)) for d in ("sglang_ext", "router") for p in sorted((root / d).rglob("*.py"))
               if any(s in p.read_text() for s in ("os.environ.get", "os.getenv", "os.environ["))]
    assert [r for r in readers if not r.startswith(("sglang_ext/offload/", "sglang_ext/disagg/"))] == []


def test_a_worker_gets_the_environment_without_the_routers_secrets() -> None:
    base = {env.API_KEY.name: "sekret", env.CACHE.name: "/c", "PATH": "/bin"}
    assert env.worker_environ({"CUDA_VISIBLE_DEVICES": "1"}, base) == {env.CACHE.name: "/c", "PATH": "/bin",
                                                                      "CUDA_VISIBLE_DEVICES": "1"}
    # not even when a worker's own `env:` names it: no worker reads it
    assert env.API_KEY.name not in env.worker_environ({env.API_KEY.name: "again"}, base)
    # nor the variables the cluster file names as holding keys (api_keys[].key_env, upstream.api_key_env)
    assert env.worker_environ({"TEAM_KEY": "x"}, {**base, "UP_KEY": "y"}, secrets=("TEAM_KEY", "UP_KEY")) == {
        env.CACHE.name: "/c", "PATH": "/bin"}
    assert [v.name for v in env.ALL if v.router_only] == [env.API_KEY.name]


def test_spawned_workers_get_that_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    from sglang_ext.entry import engine

    seen: dict[str, object] = {}

    def popen(cmd: list[str], **kw: object) -> object:
        seen.update(kw)
        return object()

    monkeypatch.setenv(env.API_KEY.name, "sekret")
    monkeypatch.setattr(subprocess, "Popen", popen)
    engine.spawn_worker(ServerArgs(), "tcp://127.0.0.1:1", "w0", {"X": "1"})
    spawned = seen["env"]
    assert isinstance(spawned, dict) and spawned["X"] == "1" and env.API_KEY.name not in spawned
