"""Which admission limits an HTTP generation request is under, waiting for room in each, and giving
the places back when the HTTP exchange ends.

A request is under up to three limits, taken in this order: its API key's, its model's, the router's.
Narrowest first, so that a request waiting for room under its key or its model holds no place of the
router's, which would keep other keys' and models' requests out. All of them share one deadline: the
smallest `queue_timeout_s` among them, counted from arrival.

The places are released by `AdmissionMiddleware` when the exchange is over -- the last byte of a
streamed response sent, an error answered, the client gone -- so a limit on requests "at once" counts
what the clients see, streams included. Only generation requests are limited; health probes
(/health_generate) and the listing endpoints are not.

Refusals are 429 with a Retry-After header (whole seconds, at least 1) and the error body of the
route's API (the OpenAI error object on /v1/*, type `rate_limit_error`, code `rate_limit_exceeded`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import ApiError, ClientGone
from router.limit_spec import ApiKey, LimitSpec
from router.resilience.limiter import Limiter, Overloaded, Permit

PERMITS: Final = "sglang_ext.permits"  # scope key: the places a request holds, released at its end
KEY_NAME: Final = "sglang_ext.api_key"  # scope key: the name of the API key it came with (never the key)
RATE_LIMITED: Final = "rate_limit_exceeded"


def retry_after_header(seconds: float) -> dict[str, str]:
    """Retry-After in whole seconds, at least 1 (RFC 9110 delay-seconds)."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


class Admission:
    def __init__(self, router: LimitSpec, models: Mapping[str, LimitSpec] | None = None,
                 keys: Sequence[ApiKey] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        default_size = router.queue_size if router.queue_size is not None else 0
        default_timeout = router.queue_timeout_s if router.queue_timeout_s is not None else 30.0

        def make(limit: str, name: str, s: LimitSpec) -> Limiter | None:
            if not s.limited:
                return None
            return Limiter(limit, name, s.max_concurrent, s.rate_rps, s.bucket,
                           s.queue_size if s.queue_size is not None else default_size,
                           s.queue_timeout_s if s.queue_timeout_s is not None else default_timeout, clock)

        self.router = make("router", "router", router)
        self.models = {n: lim for n, s in (models or {}).items() if (lim := make("model", n, s)) is not None}
        self.keys = {k.name: lim for k in keys if (lim := make("key", k.name, k.limits)) is not None}
        self.on_refused: Callable[[Overloaded], None] = lambda e: None
        self.on_admitted: Callable[[float], None] = lambda waited_s: None

    def limiters(self) -> list[Limiter]:
        return [*self.keys.values(), *self.models.values(), *([self.router] if self.router else [])]

    def applicable(self, key: str | None, model: str) -> list[Limiter]:
        lims = [self.keys.get(key or ""), self.models.get(model), self.router]
        return [lim for lim in lims if lim is not None]

    async def admit(self, request: Request, model: str) -> None:
        """Wait for room under every limit the request is under; 429 (ApiError) when there is none in
        time. The places go into the scope, for the middleware to release."""
        lims = self.applicable(request.scope.get(KEY_NAME), model)
        if not lims:
            return
        held: list[Permit] = request.scope[PERMITS]  # KeyError: the app lacks AdmissionMiddleware (a bug)
        t0 = self.clock()
        deadline = t0 + min(lim.queue_timeout_s for lim in lims)
        mark = len(held)
        try:
            for lim in lims:
                held.append(await lim.acquire(deadline, request.is_disconnected))
        except Overloaded as e:
            for p in held[mark:]:
                p.release()
            del held[mark:]
            self.on_refused(e)
            raise ApiError(429, str(e), code=RATE_LIMITED, headers=retry_after_header(e.retry_after)) from None
        except ConnectionAbortedError:
            raise ClientGone() from None  # (the middleware releases what it held)
        self.on_admitted(self.clock() - t0)


class AdmissionMiddleware:
    """Gives each HTTP request a list for the places it takes, and releases them when the exchange ends
    however it ends (pure ASGI: streams pass untouched)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: list[Permit] = []
        scope[PERMITS] = held
        try:
            await self.app(scope, receive, send)
        finally:
            for p in held:
                p.release()
