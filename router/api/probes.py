"""Probes for orchestrators: GET /health (liveness: does anything serve?) and GET /readiness (does all that
is configured serve?). Neither needs the API key (router/api/app.py's OPEN_PATHS); what they count is
router/readiness.py's.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from router.api.common import json_response
from router.core import Router
from router.errors import ApiError
from router.readiness import not_up, workers_not_up


def health(router: Router) -> Response:
    """200 with an empty body while every configured worker is up (SGLang's answer, unchanged); 200 with
    `{"status": "degraded", ...}` while some worker is up but a configured one is not (starting,
    restarting, given up on): the cluster serves, a part of it is away; 503 while no worker is up."""
    workers = router.registry.workers.values()
    if any(w.up for w in workers):
        down = workers_not_up(router)
        if not down:
            return Response(status_code=200)
        listed = "; ".join(f"{w['worker_id']} {w['state']}" for w in down)
        return json_response({"status": "degraded", "message": f"not every worker is up: {listed}", "workers": down})
    if not workers:
        raise ApiError(503, "no worker is up yet")
    raise ApiError(503, "no worker is up: " + "; ".join(f"{w.worker_id} {w.describe()}" for w in workers))


def build(router: Router) -> APIRouter:
    api = APIRouter()

    @api.get("/readiness")
    async def readiness() -> Response:
        """200 only when every configured worker, model and pairing is up; else 503 listing what is not."""
        r = not_up(router)
        if r.ready:
            return json_response({"status": "ready", "checked": r.checked})
        return json_response({"error": {"message": f"not ready: {r.summary()}", "code": 503}, "status": "not ready",
                              "workers": r.workers, "models": r.models, "pairings": r.pairings,
                              "checked": r.checked}, status=503)

    return api
