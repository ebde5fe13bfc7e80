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
        assert var.help and var.name.startswith("SGLANG_EXT_")
    missing = [f.name for f in dataclasses.fields(ServerArgs) if f"`{f.name}`" not in DOC]
    assert not missing, f"server arguments missing from docs/configuration.md: {missing}"


def test_no_other_module_reads_the_environment() -> None:
    """Outside env.py (and the remote-attention and disaggregation data planes' own switches) nothing in
    the package reads an environment variable: behaviour comes from server arguments."""
    root = Path(__file__).resolve().parent.parent
    readers = [str(p.relative_to(root)) for d in ("sglang_ext", "router") for p in sorted((root / d).rglob("*.py"))
               if any(s in p.read_text() for s in ("os.environ.get", "os.getenv", "os.environ["))]
    assert [r for r in readers if not r.startswith(("sglang_ext/offload/", "sglang_ext/disagg/"))] == []
