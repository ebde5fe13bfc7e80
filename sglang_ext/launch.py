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
import dataclasses
import os
import signal
import socket
import sys
import uuid
from typing import TYPE_CHECKING

from sglang_ext.env import API_KEY
from sglang_ext.server_args import ServerArgs

if TYPE_CHECKING:  # the router is imported only when serving, so `worker` stays light
    from router.config import Cluster


_EPILOG = f"""subcommand:
  worker --router tcp://HOST:PORT [--worker-id ID] [server flags]
                        start one worker that joins a running router
                        (`python -m sglang_ext.launch worker --help`)

The API key can also come from a file (--api-key-file) or from ${API_KEY.name}; either keeps it
out of the process list. Router settings: docs/launcher.md; every argument and environment
variable: docs/configuration.md."""


def _serve_parser() -> argparse.ArgumentParser:
    from router.config import add_router_flags

    p = argparse.ArgumentParser(prog="python -m sglang_ext.launch",
                                usage="%(prog)s [server and router flags]\n       %(prog)s worker --router "
                                      "tcp://HOST:PORT [--worker-id ID] [server flags]",
                                description="Serve models (SGLang-native and OpenAI HTTP APIs).", epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(p)
    g = p.add_argument_group("router")
    g.add_argument("--config", default=None, help="cluster YAML: several models and workers (docs/launcher.md)")
    g.add_argument("--dp-size", type=int, default=1, help="replicas of the model (one worker process each)")
    add_router_flags(g)
    return p


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_ext.launch worker",
                                description="Start one worker that joins a running router.")
    p.add_argument("--router", required=True, help="the router's worker address, tcp://HOST:PORT")
    p.add_argument("--worker-id", default=None, help="unique id (default: HOST-PID); reuse it to replace a worker")
    ServerArgs.add_cli_args(p)
    return p


def _cluster_from_flags(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> Cluster:
    from router.config import (
        Cluster,
        ConfigError,
        LocalWorker,
        flag_name,
        load_cluster,
        model_name,
        resolve_api_key,
        router_config,
        router_flag_values,
    )

    try:
        if ns.config:
            defaults = vars(parser.parse_args([]))
            given = sorted(k for k, v in vars(ns).items() if k != "config" and v != defaults.get(k))
            if given:
                flags = ", ".join(flag_name(k) if k in router_flag_values(ns) else "--" + k.replace("_", "-")
                                  for k in given)
                parser.error(f"{flags} cannot be combined with --config; put them in the file")
            cluster = load_cluster(ns.config)
        else:
            args = ServerArgs.from_cli(ns)
            if ns.dp_size < 1:
                parser.error(f"--dp-size must be >= 1, got {ns.dp_size}")
            name = model_name(args.model_path, args.served_model_name)
            # Workers never see the key: it would show in their command line (`ps`), and they don't need it.
            worker_args = dataclasses.replace(args, api_key=None)
            workers = tuple(LocalWorker(f"{name}-{i}", name, "serve", worker_args) for i in range(ns.dp_size))
            cluster = Cluster(router_config(router_flag_values(ns), "flags"), workers, (name,))
        return dataclasses.replace(cluster, router=resolve_api_key(cluster.router))
    except (ConfigError, ValueError) as e:
        parser.error(str(e))


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
    proc = spawn_worker(dataclasses.replace(args, api_key=None), ns.router, worker_id)  # not in `ps`
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
