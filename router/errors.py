"""The errors an HTTP request can end in, raised anywhere below the routes (`api/`, `resilience/`) and
rendered by the app (router/api/app.py): `ApiError` (a status and a message naming the problem) and
`ClientGone` (the client left first).

They live below both `api/` and `resilience/` so that admission (resilience/admission.py) can refuse a
request with a 429 without importing the HTTP package that imports it. Input quoted in a message is
clipped (`clip`), and no message is longer than MAX_MESSAGE_CHARS, so a huge bad input never comes back
as a huge error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

ECHO_CHARS: Final = 200  # of a client's value quoted in an error message
MAX_MESSAGE_CHARS: Final = 1000  # of a whole error message (library messages may quote input too)


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """`text` whole when short; else its first `limit` characters and its length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})  # e.g. Retry-After on a 429 or 503


class ClientGone(Exception):
    """The client disconnected before the response started (while uploading, or while waiting)."""
