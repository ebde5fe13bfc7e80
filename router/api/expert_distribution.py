"""SGLang's expert distribution recorder endpoints: POST /start_expert_distribution_record,
/stop_expert_distribution_record and /dump_expert_distribution_record (docs/api.md).

Each goes to every up worker of one model (`model`, default the default model) that the router runs,
as an `ExpertDistributionReq`; each worker keeps its own record (sglang_ext/worker/expert_distribution.py)
and a dump writes one file pair per worker. The worker says why it refuses (a dense model, a server
without --expert-distribution-recorder-mode, a stop without a start, an unwritable output_dir): a 400.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final, Literal

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from router.api.common import convert, json_response, read_json
from router.api.native_protocol import resolve_model
from router.core import Router
from router.errors import ApiError
from sglang_ext.messages import ExpertDistributionReq

Action = Literal["start", "stop", "dump"]
TIMEOUT_S: Final = 60.0  # a worker answers between steps; a dump copies [layers, experts] and writes two small files
HEADS: Final = {
    "start": "Started recording the expert distribution",
    "stop": "Stopped recording the expert distribution",
    "dump": "Dumped the expert distribution",
}


class RecordBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None
    output_dir: str | None = None  # where dumps go from now on (any of the three may set it)


def build(router: Router) -> APIRouter:
    api = APIRouter()

    @api.post("/start_expert_distribution_record")
    async def start(request: Request) -> Response:
        return await _fan_out(router, "start", await _body(request))

    @api.post("/stop_expert_distribution_record")
    async def stop(request: Request) -> Response:
        return await _fan_out(router, "stop", await _body(request))

    @api.post("/dump_expert_distribution_record")
    async def dump(request: Request) -> Response:
        return await _fan_out(router, "dump", await _body(request))

    return api


async def _body(request: Request) -> RecordBody:
    data = await read_json(request) if await request.body() else {}
    body: RecordBody = convert(data, RecordBody)
    return body


async def _fan_out(router: Router, action: Action, body: RecordBody) -> Response:
    m = resolve_model(router.registry, body.model)
    workers = [w for w in m.up_workers if w.worker_id not in router.links]
    if not workers:
        if m.up_workers:
            raise ApiError(400, f"model {m.name!r} is served by url: workers only, which this endpoint cannot reach")
        raise ApiError(503, f"no worker of model {m.name!r} is up")
    out = body.output_dir or ""

    def make(rid: str) -> ExpertDistributionReq:
        return ExpertDistributionReq(rid=rid, action=action, output_dir=out)

    replies = await asyncio.gather(*(router.request_reply(w, make, TIMEOUT_S) for w in workers))
    per: dict[str, dict[str, Any]] = {}
    refused, silent = [], []
    for w, r in zip(workers, replies, strict=True):
        if r is None:
            silent.append(f"{w.worker_id}: no answer in {TIMEOUT_S:.0f} s")
        elif not r.ok:
            refused.append(str(r.data.get("error")))
        else:
            per[w.worker_id] = {"message": r.data.get("message"), "files": list(r.data.get("files") or [])}
    if refused or silent:
        done = f" (done on {', '.join(per)})" if per else ""
        raise ApiError(400 if refused else 503, "; ".join(refused + silent) + done)
    files = [f for p in per.values() for f in p["files"]]
    return json_response({"message": f"{HEADS[action]} of model {m.name!r} on {len(per)} worker(s).",
                          "workers": per, **({"files": files} if action == "dump" else {})})
