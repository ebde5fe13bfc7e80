"""`Upstreams`: the `url:` workers of a cluster, one link each over one shared HTTP client."""

from __future__ import annotations

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
