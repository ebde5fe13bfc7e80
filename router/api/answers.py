"""Counting every answer in `sglang:num_requests_total{model_name, status}`.

The core counts the requests it was handed, one per worker-level request, when each finishes (`ok`,
`abort`, or the HTTP status of its failure). Requests refused before that (bad input, 401, 404, 413,
a 429 or 503 before submission, a server bug's 500) never reach it: `CountAnswers`, the outermost
middleware, counts those by the status of the answer. What it must not count again it learns from a
per-request `Outcome`, which the endpoint code marks through a context variable (the endpoints don't
see the ASGI scope) and the connection guard through the scope (it answers some requests itself).

Successful answers outside the core (health checks, /metrics scrapes, model lists) are not requests
to serve and are not counted; every answer of status >= 400 is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SCOPE_KEY: Final = "sglang_ext.outcome"
CLIENT_CLOSED: Final = 499  # the app's answer when the client left first (nginx's code; nobody reads it)

CountFn = Callable[[str, str], None]  # (model_name, status)


@dataclass
class Outcome:
    model: str = ""  # the served model the request named, once resolved ("" before, or when it has none)
    counted: bool = False  # by the core (it was submitted) or by the connection guard (it answered)


_current: ContextVar[Outcome | None] = ContextVar("sglang_ext_outcome", default=None)


def status_label(status: int) -> str:
    # The core labels a request whose client left "abort"; the same outcome here gets the same label.
    return "abort" if status == CLIENT_CLOSED else str(status)


def note_model(name: str) -> None:
    """The request resolved to served model `name` (only served names: labels stay few)."""
    outcome = _current.get()
    if outcome is not None:
        outcome.model = name


def note_submitted() -> None:
    """The core has the request now, and counts it when it finishes."""
    outcome = _current.get()
    if outcome is not None:
        outcome.counted = True


def note_answered(scope: Mapping[str, object]) -> None:
    """The connection guard answered this request itself (and counted that)."""
    outcome = scope.get(SCOPE_KEY)
    if isinstance(outcome, Outcome):
        outcome.counted = True


class CountAnswers:
    """Counts each answer nobody else counts (pure ASGI: responses stream untouched)."""

    def __init__(self, app: ASGIApp, count: CountFn) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        outcome = Outcome()
        scope[SCOPE_KEY] = outcome
        token = _current.set(outcome)
        status: int | None = None

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            # Starlette's outermost middleware answers an unhandled exception with a 500 (unless a
            # response already started: then its status stands).
            if status is None:
                status = 500
            raise
        finally:
            _current.reset(token)
            if status is not None and status >= 400 and not outcome.counted:
                self.count(outcome.model, status_label(status))
