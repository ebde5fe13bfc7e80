"""SGLang-native endpoints: /generate, /get_model_info, /get_server_info, /flush_cache, /health, ..."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from router.api import probes
from router.api.answers import note_submitted
from router.api.common import DONE, EventStream, SSEResponse, json_response, read_json, sse
from router.api.limits import check_prompt_size
from router.api.native_protocol import GeneratePlan, parse_generate, resolve_model
from router.core import NoWorker, Router, prefix_key
from router.errors import ApiError, clip
from router.resilience.admission import retry_after_header
from router.routing.balancer import ModelRouting
from router.tracker import Submission
from sglang_ext import __version__
from sglang_ext.entry.outputs import merge_output, new_result
from sglang_ext.messages import GenerateReq
from sglang_ext.sampling.params import SamplingParams


def submit(router: Router, plan: GeneratePlan) -> Submission:
    dup = [r.rid for r in plan.reqs if r.rid in router.requests]
    if dup or len({r.rid for r in plan.reqs}) != len(plan.reqs):
        listed = clip(", ".join(dup)) or "repeated in this request"
        raise ApiError(400, f"duplicate request id(s): {listed}", param="rid")
    try:
        placement = router.place(plan.model, prefix_key(plan.reqs[0]) if plan.reqs else None)
    except NoWorker as e:
        wait = e.retry_after
        raise ApiError(503, str(e), headers=retry_after_header(wait) if wait is not None else None) from None
    check_prompt_size(placement.worker.info, plan.reqs)
    sub = router.submit(plan.model, plan.reqs, plan.est_tokens, placement)
    note_submitted()  # the core counts it in sglang:num_requests_total from here on
    return sub


async def collect(sub: Submission, request: Request | None) -> list[dict[str, Any]]:
    """Wait for every sub-request; the SGLang result dicts in submission order."""
    results = [new_result() for _ in sub.states]
    events = EventStream(sub, on_restart=lambda i: results.__setitem__(i, new_result()))
    while (item := await events.next(request)) is not None:
        i, out = item
        merge_output(results[i], out.text_delta, out.token_ids, out.meta_info)
    return results


def build(router: Router) -> APIRouter:
    api = APIRouter()

    @api.post("/generate")
    async def generate(request: Request) -> Response:
        plan = parse_generate(await read_json(request), router.registry, router.new_rid)
        await router.resilience.admission.admit(request, plan.model.name)  # 429 when over a limit
        sub = submit(router, plan)
        if not plan.stream:
            results = await collect(sub, request)
            return json_response(results[0] if plan.single else results)
        events = EventStream(sub)
        first = await events.next(request)  # errors before the first token keep their HTTP status
        return SSEResponse(_stream(events, first, plan.single), on_close=sub.abort)

    async def _stream(events: EventStream, first: Any, single: bool) -> AsyncIterator[bytes]:
        # SGLang streams cumulative text / output_ids with the latest meta_info.
        accs: dict[int, dict[str, Any]] = {}
        item = first
        try:
            while item is not None:
                i, out = item
                acc = accs.setdefault(i, new_result())
                merge_output(acc, out.text_delta, out.token_ids, out.meta_info)
                chunk = {"text": acc["text"], "output_ids": acc["output_ids"], "meta_info": acc["meta_info"]}
                if not single:
                    chunk["index"] = i
                yield sse(chunk)
                item = await events.next()
        except ApiError as e:
            yield sse({"error": {"message": e.message, "code": e.status}})
        yield DONE

    @api.get("/get_model_info")
    async def get_model_info(model: str | None = None) -> Response:
        m = resolve_model(router.registry, model)
        info = m.info
        if info is None:
            raise ApiError(503, f"no worker of model {m.name!r} has registered yet")
        return json_response({
            "model_path": info.model_path, "tokenizer_path": info.model_path, "served_model_name": m.name,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": info.architecture, "architectures": [info.architecture],
            "context_length": info.context_length,
        })

    async def server_info() -> Response:
        return json_response(server_info_dict(router))

    api.add_api_route("/get_server_info", server_info, methods=["GET"])
    api.add_api_route("/server_info", server_info, methods=["GET"])

    @api.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok, message = await router.flush_cache()
        return Response(message, status_code=200 if ok else 400, media_type="text/plain")

    @api.get("/health")
    async def health() -> Response:
        return probes.health(router)  # and /readiness beside it: router/api/probes.py

    @api.get("/health_generate")
    async def health_generate(request: Request, model: str | None = None) -> Response:
        """Generate one token on every model (or the one asked for); 200 only if all answer."""
        names = [model] if model else list(router.registry.models)
        if not names:
            raise ApiError(503, "no model is registered yet")
        for name in names:
            m = resolve_model(router.registry, name)
            req = GenerateReq(rid=router.new_rid(), input_ids=[1, 2, 3],
                              sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
            plan = GeneratePlan(m, [req], [3], single=True, stream=False)
            await collect(submit(router, plan), request)
        return Response(status_code=200)

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return api


def server_info_dict(router: Router) -> dict[str, Any]:
    reg = router.registry
    models: dict[str, Any] = {}
    states: list[dict[str, Any]] = []
    for name, m in reg.models.items():
        workers = []
        for w in m.workers.values():
            d: dict[str, Any] = {"worker_id": w.worker_id, "role": w.role, "up": w.up, "state": w.describe(),
                                 "restarts": w.supervision.restarts if w.supervision else 0,
                                 "inflight": len(w.inflight), "num_served": w.num_served,
                                 "outstanding_tokens": w.outstanding_tokens,
                                 "last_seen_s_ago": round(time.monotonic() - w.last_seen, 3) if w.last_seen else None}
            if w.info is not None:
                d["info"] = msgspec.to_builtins(w.info)
            d["circuit"] = router.resilience.breakers.describe(w.worker_id)
            if w.load is not None:
                d["load"] = w.load.flat()  # the flat names clients read
                states.append({"model": name, **d["load"]})
            workers.append(d)
        info = m.info
        models[name] = {"model_path": info.model_path if info else None,
                        "context_length": info.context_length if info else None, "workers": workers}
    default = reg.resolve(None)
    info = default.info if default else None
    placement = router.describe_placement()
    return {
        "version": __version__,
        "model_path": info.model_path if info else None,
        "served_model_name": default.name if default else None,
        "context_length": info.context_length if info else None,
        "max_total_num_tokens": info.max_total_tokens if info else None,
        "page_size": info.page_size if info else None,
        "host": router.config.host, "port": router.config.port, "worker_addr": router.worker_addr,
        "heartbeat_timeout_s": router.config.heartbeat_timeout_s,
        "api_key_required": bool(router.resilience.credentials(router.config.api_key)),
        "models": models,
        "internal_states": states,
        "num_inflight_requests": len(router.requests),
        "offload": placement.get("offload", []),
        "disaggregation": placement.get("disaggregation", []),
        "routing": router.balancer.describe() if isinstance(router.balancer, ModelRouting) else {},
        "uptime_s": round(time.time() - router.started, 3),
    }
