"""`python -m sglang_ext.launch`: defaults, clean stops without orphans, and config errors."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from _router_util import ROOT, SMALL, Proc, Server, free_port, sse_events, wait_for


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_dead(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still alive: {[p for p in pids if pid_alive(p)]}"
        time.sleep(0.1)


def worker_pids(srv: Server) -> list[int]:
    return [w["info"]["pid"] for m in srv.info()["models"].values() for w in m["workers"] if w.get("info")]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_no_arguments_serves_default_on_30000_and_ctrl_c_stops(tmp_path: Path) -> None:
    if not port_free(30000):
        pytest.skip("127.0.0.1:30000 is in use on this machine")
    srv = Server([], tmp_path / "default.log", 30000)
    try:
        srv.wait_workers(1)
        assert "listening on http://127.0.0.1:30000" in srv.log()
        r = httpx.post(srv.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) <= 2
        pids = worker_pids(srv)
        srv.signal(signal.SIGINT)  # Ctrl-C
        assert srv.p.wait(30) == 0, srv.log()
        wait_dead(pids, 10)
        assert "stopped" in srv.log()
    finally:
        srv.stop()


def test_sigterm_stops_replicas_without_orphans(tmp_path: Path) -> None:
    port = free_port()
    srv = Server([*SMALL, "--port", str(port), "--dp-size", "2"], tmp_path / "dp.log", port)
    try:
        srv.wait_workers(2)
        assert sorted(srv.up_workers()["default"]) == ["default-0", "default-1"]
        pids = worker_pids(srv)
        # An open stream ends with a 503 event instead of holding up the stop.
        body = {"text": "endless", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/generate", json=body) as r:
            events = sse_events(r.iter_lines())
            next(events)
            t0 = time.monotonic()
            srv.signal(signal.SIGTERM)
            last = list(events)[-1]
        assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"]
        assert srv.p.wait(30) == 0, srv.log()
        assert time.monotonic() - t0 < 15
        wait_dead(pids, 10)
    finally:
        srv.stop()


def test_workers_exit_when_the_launcher_is_killed(tmp_path: Path) -> None:
    port = free_port()
    srv = Server([*SMALL, "--port", str(port)], tmp_path / "killed.log", port)
    try:
        srv.wait_workers(1)
        pids = worker_pids(srv)
        srv.p.send_signal(signal.SIGKILL)  # no cleanup at all: the worker must notice by itself
        srv.p.wait(10)
        wait_dead(pids, 10)
    finally:
        srv.stop()


def _launch(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sglang_ext.launch", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(("yaml_text", "needle"), [
    ("models: [{name: a, replicaz: 2}]", "replicaz"),
    ("models: [{name: a, args: {max_total_tokenz: 5}}]", "max_total_tokenz"),
    ("models: [{name: a, workers: [{role: chef}]}]", "role"),
    ("models: [{name: a}, {name: a}]", "used twice"),
    ("models: []", "at least one model"),
    ("router: {port: '80'}\nmodels: [{name: a}]", "port"),
    ("models: [{name: a, args: {port: 1}}]", "router section"),
])
def test_config_errors_name_the_problem(tmp_path: Path, yaml_text: str, needle: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml_text)
    p = _launch(["--config", str(cfg)])
    assert p.returncode == 2 and needle in p.stderr, p.stderr


def test_config_excludes_other_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "ok.yaml"
    cfg.write_text("models: [{name: a}]")
    p = _launch(["--config", str(cfg), "--port", "1234"])
    assert p.returncode == 2 and "--port cannot be combined with --config" in p.stderr
    p = _launch(["--config", str(cfg), "--heartbeat-timeout", "9"])
    assert p.returncode == 2 and "--heartbeat-timeout cannot be combined with --config" in p.stderr


def test_bad_model_path_exits_with_error(tmp_path: Path) -> None:
    p = _launch(["--model-path", str(tmp_path / "missing"), "--port", str(free_port())], timeout=180)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "no worker started" in p.stdout and "is not a local directory" in p.stderr


def test_worker_subcommand_needs_router() -> None:
    p = _launch(["worker"])
    assert p.returncode == 2 and "--router" in p.stderr
    p = _launch(["worker", "--router", "localhost:5"])
    assert p.returncode == 2 and "tcp://" in p.stderr


def test_help_lists_sglang_flags_and_the_worker_subcommand() -> None:
    out = _launch(["--help"]).stdout
    for flag in ("--model-path", "--port", "--mem-fraction-static", "--max-total-tokens", "--api-key",
                 "--chunked-prefill-size", "--page-size", "--config", "--dp-size", "--api-key-file",
                 "--max-request-mb", "--max-connections", "--header-timeout", "--restart-backoff",
                 "--step-log-interval-s", "--profile-dir", "--profile-start-step", "--profile-num-steps"):
        assert flag in out
    assert "worker --router tcp://HOST:PORT" in out and "SGLANG_EXT_API_KEY" in out
    assert "step profile lines" in out and "torch.profiler" in out  # the diagnostics' help texts
    assert "--profile-dir" in _launch(["worker", "--help"]).stdout  # a worker that joins by itself has them too


def test_log_mentions_worker_address(tmp_path: Path) -> None:
    # A quick check of what a user needs to attach a remote worker: the printed ZeroMQ address.
    port = free_port()
    srv = Proc(["-m", "sglang_ext.launch", *SMALL, "--port", str(port), "--worker-port", str(free_port())],
               tmp_path / "addr.log")
    try:
        deadline = time.monotonic() + 60
        while "workers join at tcp://127.0.0.1:" not in srv.log():
            assert srv.alive() and time.monotonic() < deadline, srv.log()
            time.sleep(0.1)
    finally:
        srv.stop()


def test_router_restart_keeps_remote_workers(tmp_path: Path) -> None:
    """A worker started with `launch worker` outlives its router (stopped cleanly: only the launcher's
    own workers are shut down); a new router on the same worker port takes it back (it asks the
    unknown worker to say hello again)."""
    from _router_util import start_worker

    wport = free_port()
    cfg = tmp_path / "empty.yaml"

    def router(name: str) -> Server:
        port = free_port()
        cfg.write_text(f"router: {{port: {port}, worker_port: {wport}, log_level: warning}}\n"
                       "models: [{name: remote, replicas: 0}]\n")
        return Server(["--config", str(cfg)], tmp_path / f"{name}.log", port)

    first = router("first")
    worker = start_worker(tmp_path, f"tcp://127.0.0.1:{wport}", "remote-0", ["--served-model-name", "remote"])
    second = None
    try:
        first.wait_workers(1)
        first.signal(signal.SIGTERM)
        assert first.p.wait(20) == 0
        second = router("second")
        second.wait_workers(1, timeout=60)
        r = httpx.post(second.url + "/generate", json={"text": "back", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        assert worker.alive()
    finally:
        for p in (second, first, worker):
            if p is not None:
                p.stop()


def test_killed_worker_is_restarted_and_health_tells_the_truth(tmp_path: Path) -> None:
    port = free_port()
    srv = Server([*SMALL, "--port", str(port), "--restart-backoff", "2"], tmp_path / "restart.log", port)
    try:
        srv.wait_workers(1)
        pid = srv.worker("default-0")["info"]["pid"]
        os.kill(pid, signal.SIGKILL)  # as the OOM killer would
        seen: list[str] = []

        def back() -> bool:
            r = httpx.get(srv.url + "/health", timeout=10)
            if r.status_code == 503:
                seen.append(r.json()["error"]["message"])
            return r.status_code == 200 and bool(seen)

        wait_for(back, 120, "the worker restarted", poll=0.05)
        assert any("default-0 restarting (restart 1 in" in m and "code -9" in m for m in seen), seen
        assert any("default-0 starting (restart 1)" in m for m in seen), seen
        w = srv.worker("default-0")
        assert w["up"] and w["restarts"] == 1 and w["info"]["pid"] != pid and w["state"] == "up"
        r = httpx.post(srv.url + "/generate", json={"text": "back", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        assert "restarting it in 2.0 s" in srv.log()
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'sglang_ext:worker_restarts_total{model_name="default",worker="default-0"} 1.0' in metrics
    finally:
        srv.stop()


def test_worker_with_a_configuration_error_is_given_up_at_once(tmp_path: Path) -> None:
    """A bad model path stops the worker with exit code 2 (a startup configuration error):
    restarting would fail the same way, so supervision gives up on the first exit. (Runtime crashes
    are restarted for ever, with a capped backoff: tests/test_router_procs.py.) The launcher serves
    the other model; /health says it is degraded, /readiness that it is not ready, and why."""
    port = free_port()
    args = {"max_total_tokens": 16384, "dtype": "float32", "device": "cpu", "log_level": "warning"}
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump({
        "router": {"port": port, "log_level": "warning", "restart_backoff_s": 0.2, "restart_max_fast_crashes": 3},
        "models": [{"name": "good", "args": args},
                   {"name": "bad", "model_path": str(tmp_path / "missing"), "args": args}]}))
    srv = Server(["--config", str(cfg)], tmp_path / "giveup.log", port)
    try:
        srv.wait_workers(1)
        w = wait_for(lambda: (x := srv.worker("bad-0"))["state"].startswith("gave up") and x, 180, "bad-0 given up")
        assert w["restarts"] == 0 and "configuration error" in w["state"] and not w["up"]
        time.sleep(1.0)
        assert srv.worker("bad-0")["restarts"] == 0  # no more attempts
        assert srv.log().count("not restarting it again") == 1
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 200  # "good" is up
        assert health.json()["status"] == "degraded" and [w["worker_id"] for w in health.json()["workers"]] == ["bad-0"]
        ready = httpx.get(srv.url + "/readiness")
        assert ready.status_code == 503 and ready.json()["workers"][0]["state"].startswith("gave up: a configuration")
        assert ready.json()["models"] == [{"model": "bad", "state": "no worker is up"}]
        r = httpx.post(srv.url + "/generate", json={"model": "bad", "text": "x"})
        assert r.status_code == 503
        r = httpx.post(srv.url + "/generate", json={"model": "good", "text": "x",
                                                    "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
    finally:
        srv.stop()


def test_api_key_stays_out_of_worker_command_lines(tmp_path: Path) -> None:
    key = "sekret-cmdline-key"
    port = free_port()
    srv = Server([*SMALL, "--port", str(port), "--api-key", key], tmp_path / "key.log", port, api_key=key)
    try:
        srv.wait_workers(1)
        cmdline = Path(f"/proc/{srv.worker('default-0')['info']['pid']}/cmdline").read_bytes()
        assert b"sglang_ext.worker" in cmdline and key.encode() not in cmdline
        wait_for(lambda: "ready:" in srv.log(), 30, "the ready line")
        assert 'Bearer $SGLANG_EXT_API_KEY' in srv.log() and key not in srv.log()
    finally:
        srv.stop()
    # `launch worker` takes the server flags too; its worker child gets no key either.
    joiner = Proc(["-m", "sglang_ext.launch", "worker", "--router", f"tcp://127.0.0.1:{free_port()}", *SMALL,
                   "--api-key", key], tmp_path / "joiner.log")
    try:
        m = wait_for(lambda: re.search(r"\(pid (\d+)\) joining", joiner.log()), 30, "the worker's pid")
        cmdline = Path(f"/proc/{m.group(1)}/cmdline").read_bytes()
        assert b"sglang_ext.worker" in cmdline and key.encode() not in cmdline
    finally:
        joiner.stop()


def test_api_key_from_the_environment(tmp_path: Path) -> None:
    key = "env-key-456"
    port = free_port()
    srv = Server([*SMALL, "--port", str(port)], tmp_path / "env.log", port, api_key=key,
                 env={"SGLANG_EXT_API_KEY": key})
    try:
        srv.wait_workers(1)
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        # The router's secret stays with the router: not in its worker's environment either.
        environ = Path(f"/proc/{srv.worker('default-0')['info']['pid']}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith(b"SGLANG_EXT_API_KEY=") or key.encode() in v]
        assert b"PYTHONUNBUFFERED=1" in environ  # (the rest of it is inherited as before)
    finally:
        srv.stop()
