"""`Upstreams`: the `url:` workers of a cluster, one link each over one shared HTTP client."""

from __future__ import annotations

import logging

import httpx

from router.upstream.link import UpstreamHost, UpstreamLink
from router.upstream.spec import UrlWorker


class Upstreams:
    def __init__(self, host: UpstreamHost, workers: tuple[UrlWorker, ...]) -> None:
        self.host = host
        self.workers = workers
        self.client: httpx.AsyncClient | None = None
        self.links: list[UpstreamLink] = []

    def start(self) -> None:
        if not self.workers:
            return
        quiet_http_client_logs()
        # No connection cap (the router's own HTTP limits bound the requests in flight), and no proxy
        # from the environment: a router reaches its backends directly.
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                                        trust_env=False)
        self.links = [UpstreamLink(self.host, w, self.client) for w in self.workers]
        for link in self.links:
            link.start()

    async def stop(self) -> None:
        for link in self.links:
            await link.close()
        self.links = []
        if self.client is not None:
            await self.client.aclose()
            self.client = None


def quiet_http_client_logs() -> None:
    """httpx logs every request at INFO: one line per health check and per proxied request of every
    `url:` worker, which buries the router's own log. The links log what matters instead: an upstream
    going down (with why) and coming back, once per change."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
