"""Workers get none of the router's secrets: a launcher whose keys come from every source the router
reads one from (its own key from $SGLANG_EXT_API_KEY or a file, `api_keys[]` from a variable and a file,
`url:` workers' upstream keys from a variable and a file) starts a real worker (CPU, the built-in model);
neither the worker's environment (/proc/PID/environ) nor its command line holds any of the keys or the
variables named for them, while the router still accepts every key and sends the upstream keys."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from _fake_openai import FakeOpenAI
from _router_util import Server, free_port

from sglang_ext.env import API_KEY

ARGS = {"max_total_tokens": 16384, "dtype": "float32", "device": "cpu", "log_level": "warning"}
SECRETS = {  # variable -> its secret (distinct, so that a leak names its source)
    API_KEY.name: "router-key-from-env-3f9a",
    "TEAM_KEY": "team-key-from-env-81c2",
    "UPSTREAM_KEY": "upstream-key-from-env-5d07",
}
FILE_SECRETS = {"router.key": "router-key-from-file-b4e1", "web.key": "web-key-from-file-0a6c",
                "upstream.key": "upstream-key-from-file-77f3"}


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakeOpenAI, FakeOpenAI]]:
    a, b = FakeOpenAI().start(), FakeOpenAI().start()
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def launch(tmp: Path, router: dict[str, object], key: str, fakes: tuple[FakeOpenAI, FakeOpenAI] | None) -> Server:
    """A launcher with every secret variable in its environment (`key`: the router key it will take)."""
    for name, secret in FILE_SECRETS.items():
        (tmp / name).write_text(secret + "\n")
    port = free_port()
    models: list[dict[str, object]] = [{"name": "tiny", "args": ARGS}]
    if fakes is not None:
        health = {"health_interval_s": 0.2}
        models.append({"name": "up", "workers": [
            {"id": "up-env", "url": fakes[0].url, "upstream": {**health, "api_key_env": "UPSTREAM_KEY"}},
            {"id": "up-file", "url": fakes[1].url, "upstream": {**health, "api_key_file": str(tmp / "upstream.key")}},
        ]})
    cfg = {"router": {"host": "127.0.0.1", "port": port, "log_level": "warning", **router}, "models": models,
           "api_keys": [{"name": "team", "key_env": "TEAM_KEY"}, {"name": "web", "key_file": str(tmp / "web.key")}]}
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(cfg))
    env = SECRETS if fakes is not None else {k: v for k, v in SECRETS.items() if k != "UPSTREAM_KEY"}
    return Server(["--config", str(tmp / "cluster.yaml")], tmp / "server.log", port, api_key=key, env=env)


def worker_pid(srv: Server) -> int:
    (w,) = srv.info()["models"]["tiny"]["workers"]
    return int(w["info"]["pid"])


def assert_no_secret(pid: int) -> None:
    """(UPSTREAM_KEY, when no `url:` worker names it, is just any variable: the test leaves it unset then.)"""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    names = {e.split(b"=", 1)[0].decode() for e in environ if e}
    assert "PATH" in names  # (what a worker does need still comes through)
    assert not names & set(SECRETS), f"secret variables in the worker's environment: {names & set(SECRETS)}"
    blob = b"\0".join(environ) + cmdline
    for secret in (*SECRETS.values(), *FILE_SECRETS.values()):
        assert secret.encode() not in blob, f"{secret} reached the worker"


def accepted(srv: Server, key: str) -> int:
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/generate", headers={"Authorization": f"Bearer {key}"},
                   json={"text": "Hi", "model": "tiny", "sampling_params": {"max_new_tokens": 2}})
        return r.status_code


def test_no_secret_from_the_environment_or_files_reaches_a_worker(
        tmp_path: Path, fakes: tuple[FakeOpenAI, FakeOpenAI]) -> None:
    srv = launch(tmp_path, {}, SECRETS[API_KEY.name], fakes)  # the router's key from $SGLANG_EXT_API_KEY
    try:
        srv.wait_workers(3)
        pid = worker_pid(srv)
        assert_no_secret(pid)
        for key in (SECRETS[API_KEY.name], SECRETS["TEAM_KEY"], FILE_SECRETS["web.key"]):
            assert accepted(srv, key) == 200
        assert accepted(srv, "wrong") == 401
        assert f"Bearer {SECRETS['UPSTREAM_KEY']}" in fakes[0].auth  # the upstream keys are still sent
        assert f"Bearer {FILE_SECRETS['upstream.key']}" in fakes[1].auth
        assert pid != os.getpid() and pid != srv.p.pid  # a worker process of its own
    finally:
        srv.stop()


def test_the_router_key_file_stays_with_the_router(tmp_path: Path) -> None:
    srv = launch(tmp_path, {"api_key_file": str(tmp_path / "router.key")}, FILE_SECRETS["router.key"], None)
    try:
        srv.wait_workers(1)
        pid = worker_pid(srv)
        assert_no_secret(pid)
        assert accepted(srv, FILE_SECRETS["router.key"]) == 200
        assert accepted(srv, SECRETS[API_KEY.name]) == 401  # the file's key, not the variable's
    finally:
        srv.stop()
