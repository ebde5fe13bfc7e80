"""The FastAPI application: routes, API-key check, and one error format per API family."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from router.api import admin, expert_distribution, native, openai_api, probes
from router.api.answers import CountAnswers
from router.api.common import error_body
from router.api.limits import BodyLimit
from router.core import Router
from router.errors import ApiError, ClientGone, clip
from router.resilience.admission import KEY_NAME, AdmissionMiddleware

OPEN_PATHS = frozenset({"/health", "/readiness"})  # orchestrators' probes carry no key


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every path but the probes (pure ASGI: streams untouched).
    `keys`: (name, key) pairs; the name of the key a request came with goes into its scope, for the
    key's own limits (router/resilience/admission.py)."""

    def __init__(self, app: ASGIApp, keys: list[tuple[str, str]]) -> None:
        self.app = app
        self.keys = [(name, key.encode()) for name, key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        token = token.strip()
        matched = None
        for name, key in self.keys:  # every key compared, in constant time: which one matched does not show
            if hmac.compare_digest(token, key) and matched is None:
                matched = name
        if scheme.lower() == b"bearer" and matched is not None:
            scope[KEY_NAME] = matched
            await self.app(scope, receive, send)
            return
        body = error_body(scope["path"], 401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                          code="invalid_api_key")
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def build_app(router: Router) -> FastAPI:
    app = FastAPI(title="sglang_ext router", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    app.include_router(native.build(router))
    app.include_router(admin.build(router))
    app.include_router(expert_distribution.build(router))
    app.include_router(probes.build(router))
    app.include_router(openai_api.build(router))

    def err(request: Request, status: int, message: str, param: str | None = None,
            code: str | None = None) -> Response:
        # A 413 leaves the rest of the body unread: the connection cannot carry another request.
        headers = {"connection": "close"} if status == 413 else None
        return Response(error_body(request.url.path, status, message, param, code), status_code=status,
                        media_type="application/json", headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> Response:
        response = err(request, e.status, e.message, e.param, e.code)
        response.headers.update(e.headers)
        return response

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the request was aborted in the worker

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        path = clip(request.url.path)
        known = {404: f"no such endpoint: {request.method} {path}",
                 405: f"method {request.method} is not allowed on {path}"}
        message = known.get(e.status_code, str(e.detail))
        return err(request, e.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> Response:
        return err(request, 400, f"invalid request: {e.errors()}")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        # A bug, never the client's fault: 500. Starlette re-raises it after this answer, and uvicorn
        # logs it with its traceback (once: not here too).
        return err(request, 500, f"internal error: {type(e).__name__}: {e}")

    app.add_middleware(AdmissionMiddleware)  # releases the admission places a request took, when it ends
    credentials = router.resilience.credentials(router.config.api_key)
    if credentials:
        app.add_middleware(ApiKeyMiddleware, keys=credentials)
    app.add_middleware(BodyLimit, limit=router.config.max_request_bytes)  # before anything reads
    # Outermost: it sees every answer, the 401s and 413s of the middlewares above included.
    app.add_middleware(CountAnswers, count=router.metrics.count_answer)
    return app
