"""The settings of a `url:` worker (`workers: [{url: ..., upstream: {...}}]` in the cluster file)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from router.keyfile import read_key_file


class UpstreamSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str | None = None  # the `model` sent upstream; default: the upstream's first in GET /v1/models
    health_path: str = "/health"  # GET, 200 = healthy (an OpenAI server without /health: /v1/models)
    health_interval_s: Annotated[float, Meta(gt=0)] = 5.0
    health_timeout_s: Annotated[float, Meta(gt=0)] = 5.0  # also the connect timeout of requests
    health_failures: Annotated[int, Meta(ge=1)] = 2  # failed checks in a row before it is down
    timeout_s: Annotated[float, Meta(gt=0)] = 300.0  # longest wait for the upstream's next bytes of a request
    api_key_file: str | None = None  # sent as `Authorization: Bearer` (a file keeps it out of the cluster file)
    api_key_env: str | None = None  # or the key from this environment variable (never passed on to workers)
    context_length: Annotated[int, Meta(ge=1)] | None = None  # default: the upstream's max_model_len, else 131072
    # Ask for the sampled tokens' ids (`return_token_ids`, vLLM >= 0.10.2): /generate's output_ids are then
    # real. Off by default: a strict OpenAI server refuses parameters it does not know.
    return_token_ids: bool = False


@dataclass(frozen=True)
class UrlWorker:
    worker_id: str
    model: str  # the router's name of its model
    url: str  # scheme://host:port[/prefix], without a trailing slash
    spec: UpstreamSpec = field(default_factory=UpstreamSpec)
    api_key: str | None = field(default=None, repr=False)


def url_worker(where: str, worker_id: str, model: str, url: str, spec: UpstreamSpec | None,
               environ: Mapping[str, str] | None = None) -> UrlWorker:
    """A checked `url:` worker; ValueError says what is wrong with it. `environ` (default: this process's
    environment) holds `api_key_env`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where}.url must look like http://HOST:PORT, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as e:
        raise ValueError(f"{where}.url {url!r}: {e}") from None
    spec = spec or UpstreamSpec()
    if not spec.health_path.startswith("/"):
        raise ValueError(f"{where}.upstream.health_path must start with '/', got {spec.health_path!r}")
    key = None
    if spec.api_key_file is not None and spec.api_key_env is not None:
        raise ValueError(f"{where}.upstream: give api_key_file or api_key_env, not both")
    if spec.api_key_env is not None:
        key = (os.environ if environ is None else environ).get(spec.api_key_env, "").strip()
        if not key:
            raise ValueError(f"{where}.upstream.api_key_env: the environment variable {spec.api_key_env} is unset "
                             "or empty")
    if spec.api_key_file is not None:
        try:
            key = read_key_file(spec.api_key_file)
        except OSError as e:
            raise ValueError(f"{where}.upstream.api_key_file: cannot read it: {e}") from None
        if not key:
            raise ValueError(f"{where}.upstream.api_key_file: {spec.api_key_file} is empty")
    return UrlWorker(worker_id, model, url.rstrip("/"), spec, key)
