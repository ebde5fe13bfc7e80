"""The router: HTTP in (SGLang-native and OpenAI APIs), ZeroMQ to workers, events for planners.

Layout: `core` (socket, dispatch, health), `tracker` (worker and request state), `registry` (models,
replicas), `routing/` (the per-model policies that pick a replica), `upstream/` (`url:` workers reached
over HTTP), `placement/` (strategies over several workers: PD, offload), `events` (the bus strategies and
planners listen to), `metrics` (Prometheus), `api/` (HTTP), `server`
(uvicorn + signals), `http_guard` (connection cap, slow-client timeouts), `procs` (local worker
processes and their supervision), `config` (settings and cluster YAML), `limit_spec` (the cluster file's
limits and API keys), `resilience/` (retries, breakers, admission), `errors` (ApiError, ClientGone),
`readiness` (what is not up).
"""

from __future__ import annotations

from router.config import Cluster, RouterConfig, load_cluster
from router.core import Router
from router.events import EventBus

__all__ = ["Cluster", "EventBus", "Router", "RouterConfig", "load_cluster"]
