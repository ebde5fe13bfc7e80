"""SGLang's endpoints beside generation: /tokenize, /detokenize, /abort_request, /start_profile,
/stop_profile and /update_weights_from_disk. Shapes follow SGLang's (docs/api.md, "Other native endpoints").

Each is answered by the workers the router runs (a `url:` worker is reached only by generation
requests): the router sends a typed message (sglang_ext/messages/io.py) and waits for the reply;
/abort_request is the router's own, since it knows which worker holds each request.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from router.api.common import convert, json_response, read_json
from router.api.native_protocol import resolve_model
from router.core import Router
from router.errors import ApiError
from router.registry import ModelEntry
from router.tracker import WorkerState
from sglang_ext.messages import DetokenizeReq, ProfileReq, ReplyOut, TokenizeReq, UpdateWeightsReq

TOKENIZE_TIMEOUT_S: Final = 60.0
PROFILE_TIMEOUT_S: Final = 120.0  # a stop writes the trace first
# A reload waits for the worker's requests in flight to finish (weights.py), then loads.
UPDATE_TIMEOUT_S: Final = 900.0
LOAD_FORMATS: Final = ("auto", "safetensors", "dummy")
ACTIVITIES: Final = ("CPU", "GPU", "CUDA")


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    prompt: str | list[str]
    model: str | None = None
    add_special_tokens: bool = True


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    tokens: list[Any]  # list[int], or a batch: list[list[int]] (checked in `_token_lists`)
    model: str | None = None
    skip_special_tokens: bool = True


class AbortBody(msgspec.Struct, forbid_unknown_fields=True):
    rid: str = ""
    abort_all: bool = False
    model: str | None = None


class ProfileBody(msgspec.Struct, forbid_unknown_fields=True):
    output_dir: str | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    model: str | None = None  # extension: only that model's workers (default: every worker)


class UpdateWeightsBody(msgspec.Struct, forbid_unknown_fields=True):
    model_path: str
    load_format: str | None = None
    model: str | None = None
    abort_all_requests: bool = False  # SGLang's: abort the model's requests first instead of draining them
    weight_version: str | None = None  # accepted for SGLang clients; not tracked
    flush_cache: bool = True  # accepted; the prefix cache is always dropped (it holds the old weights' KV)


def build(router: Router) -> APIRouter:
    api = APIRouter()

    @api.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body: TokenizeBody = convert(await read_json(request), TokenizeBody)
        w = _tokenizer_worker(router, resolve_model(router.registry, body.model))
        prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
        replies = await _ask_all(router, w, [
            lambda rid, p=p: TokenizeReq(rid=rid, text=p, add_special_tokens=body.add_special_tokens)
            for p in prompts])
        ids = [list(r.data["input_ids"]) for r in replies]
        assert w.info is not None
        one = not isinstance(body.prompt, list)
        return json_response({"tokens": ids[0] if one else ids, "count": len(ids[0]) if one else [len(x) for x in ids],
                              "max_model_len": w.info.context_length})

    @api.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body: DetokenizeBody = convert(await read_json(request), DetokenizeBody)
        w = _tokenizer_worker(router, resolve_model(router.registry, body.model))
        batch, seqs = _token_lists(body.tokens)
        replies = await _ask_all(router, w, [
            lambda rid, s=s: DetokenizeReq(rid=rid, tokens=s, skip_special_tokens=body.skip_special_tokens)
            for s in seqs])
        texts = [str(r.data["text"]) for r in replies]
        return json_response({"text": texts if batch else texts[0]})

    @api.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body: AbortBody = convert(await read_json(request), AbortBody)
        if not body.rid and not body.abort_all:
            raise ApiError(400, "give the rid of the request to abort, or abort_all: true", param="rid")
        model = resolve_model(router.registry, body.model).name if body.model is not None else None
        n = router.abort_requests(body.rid, body.abort_all, model)
        return json_response({"aborted": n})

    @api.post("/start_profile")
    async def start_profile(request: Request) -> Response:
        data = await read_json(request) if await request.body() else {}
        body: ProfileBody = convert(data, ProfileBody)
        if body.num_steps is not None and body.num_steps < 1:
            raise ApiError(400, f"num_steps must be >= 1, got {body.num_steps}", param="num_steps")
        for a in body.activities or []:
            if a.upper() not in ACTIVITIES:
                raise ApiError(400, f"activities: {a!r} is not supported (one of: CPU, GPU, CUDA)", param="activities")
        return await _profile(router, "start", body)

    @api.post("/stop_profile")
    async def stop_profile(request: Request) -> Response:
        data = await read_json(request) if await request.body() else {}
        body: ProfileBody = convert(data, ProfileBody)
        return await _profile(router, "stop", body)

    @api.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body: UpdateWeightsBody = convert(await read_json(request), UpdateWeightsBody)
        if not body.model_path:
            raise ApiError(400, "model_path must name the checkpoint directory to load", param="model_path")
        fmt = body.load_format or "auto"
        if fmt not in LOAD_FORMATS:
            raise ApiError(400, f"load_format {fmt!r} is not supported (one of: {', '.join(LOAD_FORMATS)})",
                           param="load_format")
        m = resolve_model(router.registry, body.model)
        workers = m.up_workers
        if not workers:
            raise ApiError(503, f"no worker of model {m.name!r} is up")
        if body.abort_all_requests:
            router.abort_requests(abort_all=True, model=m.name, message="aborted for a weight update")
        results = await asyncio.gather(*(_update_one(router, w, body.model_path, fmt) for w in workers))
        per = {w.worker_id: {"success": ok, "message": msg} for w, (ok, msg) in zip(workers, results, strict=True)}
        ok = all(r["success"] for r in per.values())
        if ok:
            message = f"Succeeded to update model weights of {m.name!r} from {body.model_path} on {len(per)} worker(s)."
        else:
            message = "; ".join(f"{wid}: {r['message']}" for wid, r in per.items() if not r["success"])
        return json_response({"success": ok, "message": message, "workers": per}, status=200 if ok else 400)

    return api


def _token_lists(tokens: list[Any]) -> tuple[bool, list[list[int]]]:
    """(is a batch, the id lists) of a /detokenize `tokens`."""
    batch = bool(tokens) and isinstance(tokens[0], list)
    seqs = tokens if batch else [tokens]
    for i, s in enumerate(seqs):
        if not isinstance(s, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in s):
            where = f"tokens[{i}]" if batch else "tokens"
            raise ApiError(400, f"{where} must be a list of token ids (integers)", param="tokens")
    return batch, seqs


def _tokenizer_worker(router: Router, m: ModelEntry) -> WorkerState:
    """An up worker of the model that runs here and has a tokenizer (any: they share one)."""
    if not m.up_workers:
        raise ApiError(503, f"no worker of model {m.name!r} is up")
    mine = [w for w in m.up_workers if w.worker_id not in router.links]
    if not mine:
        raise ApiError(400, f"model {m.name!r} is served by url: workers only, which this endpoint cannot reach")
    with_tok = [w for w in mine if w.info is not None and w.info.has_tokenizer]
    if not with_tok:
        raise ApiError(400, f"model {m.name!r} was started with skip_tokenizer_init: it has no tokenizer")
    return min(with_tok, key=lambda w: w.outstanding_tokens)


async def _ask_all(router: Router, w: WorkerState, makes: list[Any]) -> list[ReplyOut]:
    """One request_reply per message, concurrently; a refusal is that worker's status and message."""
    replies = await asyncio.gather(*(router.request_reply(w, make, TOKENIZE_TIMEOUT_S) for make in makes))
    for r in replies:
        if r is None:
            raise ApiError(503, f"worker {w.worker_id} did not answer in {TOKENIZE_TIMEOUT_S:.0f} s")
        if not r.ok:
            raise ApiError(int(r.data.get("status", 400)), str(r.data.get("error", "refused")))
    return replies  # type: ignore[return-value]


async def _profile(router: Router, action: str, body: ProfileBody) -> Response:
    if body.model is not None:
        workers = resolve_model(router.registry, body.model).up_workers
    else:
        workers = [w for w in router.registry.workers.values() if w.up]
    workers = [w for w in workers if w.worker_id not in router.links]
    if not workers:
        raise ApiError(503, "no worker that this router runs is up")
    msg = {"output_dir": body.output_dir or "", "num_steps": body.num_steps, "activities": body.activities or []}
    replies = await asyncio.gather(*(router.request_reply(
        w, lambda rid: ProfileReq(rid=rid, action=action, **msg), PROFILE_TIMEOUT_S)  # type: ignore[arg-type]
        for w in workers))
    lines, bad = [], []
    for w, r in zip(workers, replies, strict=True):
        if r is None:
            bad.append(f"{w.worker_id}: no answer in {PROFILE_TIMEOUT_S:.0f} s")
        elif not r.ok:
            bad.append(str(r.data.get("error")))
        else:
            lines.append(str(r.data.get("message")))
    if bad:
        done = f" (done on the others: {'; '.join(lines)})" if lines else ""
        raise ApiError(400, "; ".join(bad) + done)
    head = "Start profiling." if action == "start" else "Stop profiling."
    return Response("\n".join([head, *lines]) + "\n", media_type="text/plain")


async def _update_one(router: Router, w: WorkerState, path: str, fmt: str) -> tuple[bool, str]:
    if w.worker_id in router.links:
        return False, "a url: worker's weights are its server's: it cannot be reloaded from here"
    r = await router.request_reply(w, lambda rid: UpdateWeightsReq(rid=rid, model_path=path, load_format=fmt),
                                   UPDATE_TIMEOUT_S)
    if r is None:
        return False, f"no answer in {UPDATE_TIMEOUT_S:.0f} s"
    message = str(r.data.get("message") or r.data.get("error") or "")
    if r.ok and w.info is not None:
        w.info = msgspec.structs.replace(w.info, model_path=path)  # what /get_model_info reports now
    return r.ok, message
