"""The cluster file's limit entries and API keys, and the checks of the router-wide resilience settings.

A `LimitSpec` is one scope's admission limit: at most `max_concurrent` requests in flight and/or
`rate_rps` new requests a second (a token bucket holding `burst`), with at most `queue_size` requests
waiting for room, each for at most `queue_timeout_s`. It is a model's `limits:` and, with where its
secret comes from, each `api_keys:` entry.

Secrets never live in the cluster file (which gets copied, committed and logged): an entry names an
environment variable (`key_env`) or a file (`key_file`) to read its key from, at start. Nothing here
ever puts a secret in a message or a repr.

It lives below both router/config.py (which parses these entries) and router/resilience/ (which
enforces them), so neither imports the other through it; of the router it imports only router/keyfile.py.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Final, Protocol

import msgspec
from msgspec import Meta

from router.keyfile import read_key_file

PRIMARY_KEY_NAME: Final = "default"  # how logs and metrics name the router's own `api_key`


class LimitSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_concurrent: Annotated[int, Meta(ge=1)] | None = None  # requests in flight at most
    rate_rps: Annotated[float, Meta(gt=0)] | None = None  # new requests a second (sustained)
    burst: Annotated[int, Meta(ge=1)] | None = None  # requests admitted at once after idling (default: ceil(rate))
    queue_size: Annotated[int, Meta(ge=0)] | None = None  # waiting at most (None: the router's queue_size)
    queue_timeout_s: Annotated[float, Meta(gt=0)] | None = None  # wait at most (None: the router's)

    def __post_init__(self) -> None:
        if self.burst is not None and self.rate_rps is None:
            raise ValueError("burst is the size of a rate limit's bucket: set rate_rps too")

    @property
    def limited(self) -> bool:
        return self.max_concurrent is not None or self.rate_rps is not None

    @property
    def bucket(self) -> int:
        """The token bucket's size: `burst`, else the rate rounded up (one second's worth), at least 1."""
        if self.burst is not None:
            return self.burst
        return max(1, math.ceil(self.rate_rps or 1.0))


class ApiKeySpec(LimitSpec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One `api_keys:` entry: where its secret is, its name (for logs and metrics) and its limits."""

    name: str | None = None  # default: key_env, or key_file's file name
    key_env: str | None = None  # read the key from this environment variable
    key_file: str | None = None  # or from this file (its first line, trimmed)


@dataclass(frozen=True)
class ApiKey:
    """A resolved key: what the auth middleware compares and which limits its requests are under."""

    name: str
    secret: str = field(repr=False)
    limits: LimitSpec = field(default_factory=LimitSpec)


class SpecError(ValueError):
    """A mistake in the limit or key entries (router/config.py turns it into a ConfigError)."""


def resolve_api_keys(specs: Sequence[ApiKeySpec], environ: Mapping[str, str] | None = None) -> tuple[ApiKey, ...]:
    """Each entry's key, read from its variable in `environ` (default: this process's environment) or
    its file. Every mistake is an error naming the entry (never the secret)."""
    env = os.environ if environ is None else environ
    keys: list[ApiKey] = []
    for i, s in enumerate(specs):
        where = f"api_keys[{i}]"
        if (s.key_env is None) == (s.key_file is None):
            raise SpecError(f"{where}: give exactly one of key_env (an environment variable) or key_file (a file) "
                            "to read the key from; keys themselves never go in the cluster file")
        if s.key_env is not None:
            secret = env.get(s.key_env, "").strip()
            if not secret:
                raise SpecError(f"{where}: the environment variable {s.key_env} is unset or empty")
            name = s.name or s.key_env
        else:
            assert s.key_file is not None
            try:
                secret = read_key_file(s.key_file)
            except OSError as e:
                raise SpecError(f"{where}: cannot read the key file: {e}") from None
            if not secret:
                raise SpecError(f"{where}: the key file {s.key_file} is empty")
            name = s.name or Path(s.key_file).name
        if name == PRIMARY_KEY_NAME:
            raise SpecError(f"{where}: the name {name!r} is the router's own api_key's; choose another")
        if any(k.name == name for k in keys):
            raise SpecError(f"{where}: the key name {name!r} is used twice; set distinct `name`s")
        other = next((k.name for k in keys if k.secret == secret), None)
        if other is not None:
            raise SpecError(f"{where}: the key {name!r} is the same as the key {other!r}; give each its own")
        keys.append(ApiKey(name, secret, s))
    return tuple(keys)


class RouterKnobs(Protocol):
    """The router-wide settings checked here (fields of router.config.RouterConfig)."""

    @property
    def retry_backoff_s(self) -> float: ...
    @property
    def retry_backoff_max_s(self) -> float: ...
    @property
    def rate_limit_rps(self) -> float | None: ...
    @property
    def rate_limit_burst(self) -> int | None: ...


def check_router(cfg: RouterKnobs) -> None:
    """Settings that are wrong together (each alone is checked by its type)."""
    if cfg.retry_backoff_max_s < cfg.retry_backoff_s:
        raise ValueError(f"retry_backoff_max_s ({cfg.retry_backoff_max_s:g}) must be >= retry_backoff_s "
                         f"({cfg.retry_backoff_s:g})")
    if cfg.rate_limit_burst is not None and cfg.rate_limit_rps is None:
        raise ValueError("rate_limit_burst is the size of the router's rate-limit bucket: set rate_limit_rps too")
