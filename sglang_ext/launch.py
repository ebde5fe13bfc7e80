"""`python -m sglang_ext.launch`: serve models over HTTP, or join a running router as a worker.

    python -m sglang_ext.launch                          # embedded default model on 127.0.0.1:30000
    python -m sglang_ext.launch --model-path DIR --port 30001 --dp-size 2
    python -m sglang_ext.launch --config cluster.yaml    # several models / workers (docs/launcher.md)
    python -m sglang_ext.launch worker --router tcp://HOST:PORT [--worker-id ID] [server flags]

Server flags are SGLang's (`ServerArgs`). Ctrl-C or SIGTERM stops the router and every worker it
started; workers also exit on their own if the launcher dies.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import uuid
from typing import TYPE_CHECKING

from sglang_ext.server_args import ServerArgs

if TYPE_CHECKING:  # the router is imported only when serving, so `worker` stays light
    from router.config import Cluster


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_ext.launch",
                                description="Serve models (SGLang-native and OpenAI HTTP APIs).")
    ServerArgs.add_cli_args(p)
    g = p.add_argument_group("router")
    g.add_argument("--config", default=None, help="cluster YAML: several models and workers (docs/launcher.md)")
    g.add_argument("--dp-size", type=int, default=1, help="replicas of the model (one worker process each)")
    g.add_argument("--worker-host", default="127.0.0.1", help="address the worker-facing ZeroMQ socket binds")
    g.add_argument("--worker-port", type=int, default=0, help="port of that socket (0: a free one, printed)")
    g.add_argument("--heartbeat-timeout", type=float, default=3.0,
                   help="seconds of worker silence before it is marked down")
    return p


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_ext.launch worker",
                                description="Start one worker that joins a running router.")
    p.add_argument("--router", required=True, help="the router's worker address, tcp://HOST:PORT")
    p.add_argument("--worker-id", default=None, help="unique id (default: HOST-PID); reuse it to replace a worker")
    ServerArgs.add_cli_args(p)
    return p


def _cluster_from_flags(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> Cluster:
    from router.config import Cluster, ConfigError, LocalWorker, RouterConfig, load_cluster, model_name

    if ns.config:
        defaults = vars(parser.parse_args([]))
        given = sorted(k for k, v in vars(ns).items() if k != "config" and v != defaults.get(k))
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            parser.error(f"{flags} cannot be combined with --config; put them in the file")
        try:
            return load_cluster(ns.config)
        except ConfigError as e:
            parser.error(str(e))
    try:
        args = ServerArgs.from_cli(ns)
    except ValueError as e:
        parser.error(str(e))
    if ns.dp_size < 1:
        parser.error(f"--dp-size must be >= 1, got {ns.dp_size}")
    name = model_name(args.model_path, args.served_model_name)
    workers = tuple(LocalWorker(f"{name}-{i}", name, "serve", args) for i in range(ns.dp_size))
    router = RouterConfig(host=args.host, port=args.port, worker_host=ns.worker_host, worker_port=ns.worker_port,
                          api_key=args.api_key, heartbeat_timeout_s=ns.heartbeat_timeout, log_level=args.log_level)
    return Cluster(router, workers, (name,))


def serve(argv: list[str]) -> int:
    parser = _serve_parser()
    ns = parser.parse_args(argv)
    cluster = _cluster_from_flags(ns, parser)
    from router.server import run

    return run(cluster)


def worker(argv: list[str]) -> int:
    """Run one worker as a child (the worker ignores SIGINT: its parent decides when it stops)."""
    from sglang_ext.entry.engine import spawn_worker

    parser = _worker_parser()
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli(ns)
    except ValueError as e:
        parser.error(str(e))
    if not ns.router.startswith(("tcp://", "ipc://")):
        parser.error(f"--router must look like tcp://HOST:PORT, got {ns.router!r}")
    worker_id = ns.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    proc = spawn_worker(args, ns.router, worker_id)
    print(f"[sglang_ext] worker {worker_id} (pid {proc.pid}) joining {ns.router}", flush=True)

    def stop(sig: int, _frame: object) -> None:
        if proc.poll() is None:
            proc.terminate()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return 0 if code in (0, -signal.SIGTERM) else code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker(argv[1:])
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main"]
