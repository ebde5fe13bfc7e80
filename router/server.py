"""Run the router and its HTTP server in one asyncio (uvloop) loop until SIGINT / SIGTERM.

uvicorn's own signal capture re-raises the signal after shutdown, which would kill the process
before the workers are stopped; ours only asks the server to exit, and cleanup runs after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Generator

import uvicorn

from router.api.app import build_app
from router.config import Cluster, RouterConfig
from router.core import Router
from router.http_guard import ConnLimits, GuardedH11Protocol, connection_cap, raise_fd_limit
from router.procs import LocalWorkers
from router.routing.balancer import ModelRouting
from router.upstream.pool import Upstreams
from sglang_ext.env import API_KEY

logger = logging.getLogger(__name__)
_STARTUP_TIMEOUT_S = 900.0
_UPSTREAM_WAIT_S = 30.0  # for all `url:` workers to be up before `ready:` names the missing ones


class _Server(uvicorn.Server):
    on_exit: Callable[[], None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        for sig in sigs:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in sigs:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self.should_exit:
            self.force_exit = True  # a second Ctrl-C: stop waiting for open streams
        self.should_exit = True
        if self.on_exit is not None:
            self.on_exit()


def bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def say(msg: str) -> None:
    print(f"[sglang_ext] {msg}", flush=True)


def try_hint(cfg: RouterConfig, host: str, port: int) -> str:
    """A curl line that works as printed; the key is never printed: the line reads it from the environment."""
    auth = f" -H \"Authorization: Bearer ${API_KEY.name}\"" if cfg.api_key else ""
    hint = (f"try: curl http://{host}:{port}/generate{auth} "
            "-d '{\"text\": \"Hello\", \"sampling_params\": {\"max_new_tokens\": 8}}'")
    return hint + (f" (with the API key in ${API_KEY.name})" if cfg.api_key else "")


def uvicorn_config(router: Router, fd_limit: int) -> uvicorn.Config:
    cfg = router.config
    limits = ConnLimits(connection_cap(cfg.max_connections, fd_limit), cfg.header_timeout_s, cfg.body_timeout_s,
                        max_per_client=cfg.max_connections_per_client)
    http = GuardedH11Protocol.with_limits(limits, count=router.metrics.count_answer)
    return uvicorn.Config(build_app(router), http=http, log_level="warning",
                          access_log=False, timeout_graceful_shutdown=5,
                          timeout_keep_alive=cfg.keep_alive_timeout_s)  # type: ignore[arg-type]


async def serve_cluster(cluster: Cluster, on_ready: Callable[[Router], Awaitable[None]] | None = None) -> int:
    """Serve until a signal; returns the process exit code."""
    cfg = cluster.router
    fd_limit = raise_fd_limit()  # so that max_connections, not the OS, is what refuses connections
    try:
        http_sock = bind_http(cfg.host, cfg.port)
    except OSError as e:
        say(f"cannot listen on {cfg.host}:{cfg.port}: {e}")
        return 1
    router = Router(cfg, balancer=ModelRouting(cfg.routing_defaults, cluster.routing), slo=cluster.slo,
                    offload=cluster.offload, limits=cluster.limits, api_keys=cluster.api_keys)
    await router.start()
    for name in cluster.models:
        router.registry.declare(name)
    upstreams = Upstreams(router, cluster.upstreams)  # `url:` workers: up at their first good health check
    upstreams.start()
    workers = LocalWorkers(router, cluster.workers, secrets=cluster.key_vars)
    workers.start()
    host, port = http_sock.getsockname()[:2]
    server = _Server(uvicorn_config(router, fd_limit))
    # End running requests (503) at once, so open streams close instead of holding up the exit.
    server.on_exit = lambda: router.fail_all("the server is shutting down")
    names = list(cluster.models) or sorted({w.model for w in cluster.workers})
    say(f"listening on http://{host}:{port} (models: {', '.join(names) or 'none yet'}; "
        f"workers join at {router.worker_addr})")
    serve_task = asyncio.create_task(server.serve(sockets=[http_sock]))
    code = 0
    try:
        if cluster.workers:
            ready = asyncio.create_task(workers.wait_ready(_STARTUP_TIMEOUT_S))
            await asyncio.wait({ready, serve_task}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done():
                failed = ready.result()
                if failed and len(failed) == len(cluster.workers):
                    say(f"no worker started ({', '.join(failed)} failed); stopping")
                    server.should_exit = True
                    code = 1
                elif failed:
                    say(f"workers that failed to start: {', '.join(failed)} (restarting them with backoff)")
                if not code:
                    up = sum(1 for w in router.registry.workers.values() if w.up)
                    say(f"ready: {up} worker(s) up; {try_hint(cfg, host, port)}")
            else:
                ready.cancel()
        elif cluster.upstreams:
            upstream_ready = asyncio.create_task(_upstreams_up(router, cluster))
            await asyncio.wait({upstream_ready, serve_task}, return_when=asyncio.FIRST_COMPLETED)
            if upstream_ready.done():
                say(f"ready: {upstream_ready.result()}; {try_hint(cfg, host, port)}")
            else:
                upstream_ready.cancel()
        if on_ready is not None and not code:
            await on_ready(router)
        await serve_task
    finally:
        say("shutting down")
        if not serve_task.done():
            server.should_exit = True
            with contextlib.suppress(Exception):
                await serve_task
        await workers.stop_supervising()  # workers told to shut down must not be restarted
        await upstreams.stop()
        await router.stop(shutdown=[w.worker_id for w in cluster.workers])
        await workers.stop()
        http_sock.close()
        say("stopped")
    return code


async def _upstreams_up(router: Router, cluster: Cluster, wait_all_s: float = _UPSTREAM_WAIT_S) -> str:
    """With only `url:` workers: wait until all of them are up (their first good health check), or at
    least one once `wait_all_s` passed (the others come up when they answer; the log says which are
    down). Returns the `ready:` line's count."""
    ids = [u.worker_id for u in cluster.upstreams]
    deadline = time.monotonic() + wait_all_s
    said = False
    while True:
        up = [i for i in ids if (w := router.registry.workers.get(i)) is not None and w.up]
        late = time.monotonic() >= deadline
        if len(up) == len(ids) or (late and up):
            down = [i for i in ids if i not in up]
            return f"{len(up)} worker(s) up" + (f" ({', '.join(down)} not yet)" if down else "")
        if late and not said:
            say(f"no url: worker is up after {wait_all_s:g} s ({', '.join(ids)}); still checking their health")
            said = True
        await asyncio.sleep(0.1)


def run(cluster: Cluster) -> int:
    logging.basicConfig(level=cluster.router.log_level.upper(),
                        format="[router] %(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        import uvloop

        return uvloop.run(serve_cluster(cluster))
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(serve_cluster(cluster))
