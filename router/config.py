"""Router settings and the cluster file (`--config cluster.yaml`) schema.

`RouterConfig` is the one definition of the router's settings: the cluster file's `router:` section
decodes into it, and the launcher derives its router flags from its fields (`cli.py`). The YAML is
decoded strictly into msgspec Structs: an unknown key, a wrong type or an unknown server argument is
an error that names where it is, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Final, Literal, Union, get_args, get_origin

import msgspec
from msgspec import Meta

from router.keyfile import read_key_file
from router.limit_spec import ApiKey, ApiKeySpec, LimitSpec, SpecError, check_router, resolve_api_keys
from router.routing.settings import (
    BalanceAbs,
    BalanceRel,
    CacheAwareSpec,
    CacheThreshold,
    MaxPrefixChars,
    PolicyName,
    RoutingSettings,
    model_routing,
)
from router.upstream.spec import UpstreamSpec, UrlWorker, url_worker
from sglang_ext.env import API_KEY
from sglang_ext.offload.planning.spec import AdaptiveSpec, AdrenalineSpec
from sglang_ext.server_args import DEFAULT_PORT, ServerArgs
from sglang_ext.transport.choice import check_served

Role = Literal["serve", "hot", "cold", "prefill", "decode"]

# Router settings the launcher's server flags already carry (`--host`, `--port`, `--api-key`, `--log-level`).
SERVER_FLAG_FIELDS: Final = frozenset({"host", "port", "api_key", "log_level"})
OFFLOAD_POLICIES: Final = ("fixed", "adrenaline", "adaptive")
ADAPTIVE_START: Final = 0.45  # WEAVER's default ratio
ROUTING: Final = RoutingSettings()  # the routing defaults (router/routing/settings.py says why these)


class ConfigError(ValueError):
    pass


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The router's settings. A field's description is its launcher flag's help text."""

    host: str = "127.0.0.1"  # HTTP address (`--host`)
    port: Annotated[int, Meta(ge=0, le=65535)] = DEFAULT_PORT  # (`--port`)
    worker_host: Annotated[str, Meta(description="address the worker-facing ZeroMQ socket binds")] = "127.0.0.1"
    worker_port: Annotated[int, Meta(ge=0, le=65535, description="port of that socket (0: a free one, printed)")] = 0
    api_key: str | None = None  # Bearer key for everything but /health (`--api-key`)
    api_key_file: Annotated[str | None, Meta(
        description=f"read the API key from this file (keeps it out of `ps`; also ${API_KEY.name})")] = None
    heartbeat_timeout_s: Annotated[float, Meta(
        gt=0, description="seconds of worker silence before it is marked down")] = 3.0
    log_level: str = "info"  # (`--log-level`)
    # Routing over a model's replicas (router/routing/): defaults for models without their own `routing:`.
    routing: PolicyName = ROUTING.policy
    cache_threshold: CacheThreshold = ROUTING.cache_threshold
    balance_abs_threshold: BalanceAbs = ROUTING.balance_abs_threshold
    balance_rel_threshold: BalanceRel = ROUTING.balance_rel_threshold
    max_prefix_chars: MaxPrefixChars = ROUTING.max_prefix_chars
    # HTTP hardening: bounded request size, connections and time per connection.
    max_request_mb: Annotated[float, Meta(gt=0, description="largest HTTP request body in MiB (larger: 413)")] = 32.0
    max_connections: Annotated[int, Meta(ge=1, description="open HTTP connections at most (more: 503)")] = 4096
    max_connections_per_client: Annotated[int, Meta(ge=1, description=(
        "open HTTP connections from one client address at most (IPv6: one /64; more: 429)"))] = 1024
    header_timeout_s: Annotated[float, Meta(
        gt=0, description="seconds for a connection to send its request headers before it is closed")] = 10.0
    body_timeout_s: Annotated[float, Meta(
        gt=0, description="seconds for a request body to arrive, once its headers have (else 408)")] = 60.0
    keep_alive_timeout_s: Annotated[float, Meta(
        gt=0, description="seconds an idle keep-alive connection stays open")] = 5.0
    # Supervision of the workers the launcher starts.
    restart_backoff_s: Annotated[float, Meta(
        gt=0, description="wait before restarting a crashed local worker; doubles per fast crash")] = 1.0
    restart_backoff_max_s: Annotated[float, Meta(gt=0, description="longest wait between restarts")] = 60.0
    # Restarts never stop (the launcher stays up, so it keeps trying); this only says when to call it a loop.
    restart_max_fast_crashes: Annotated[int, Meta(
        ge=1, description="log an error once a local worker crashed this many times in a row, each soon after "
                          "its start (it is still restarted)")] = 5
    restart_fast_crash_s: Annotated[float, Meta(
        gt=0, description="a crash within this many seconds of start counts as fast")] = 60.0
    # Resilience (router/resilience/): retries, circuit breakers, admission limits. docs/configuration.md.
    max_retries: Annotated[int, Meta(
        ge=0, description="retries of a request a worker failed before its client got any output (0: none)")] = 2
    retry_backoff_s: Annotated[float, Meta(
        ge=0, description="wait before the first retry; multiplied by retry_backoff_multiplier per retry")] = 0.05
    retry_backoff_max_s: Annotated[float, Meta(ge=0, description="longest wait before a retry")] = 2.0
    retry_backoff_multiplier: Annotated[float, Meta(ge=1, description="growth of the wait per retry")] = 2.0
    retry_jitter: Annotated[float, Meta(
        ge=0, le=1, description="each wait varies randomly by up to this share, up or down")] = 0.2
    cb_failure_threshold: Annotated[int, Meta(
        ge=0, description="failures in a row that open a worker's circuit breaker (0: not on a count)")] = 5
    cb_failure_rate: Annotated[float, Meta(
        gt=0, le=1, description="also open it when this share of its requests over --cb-window failed")] | None = None
    cb_window_s: Annotated[float, Meta(gt=0, description="window of --cb-failure-rate")] = 60.0
    cb_min_requests: Annotated[int, Meta(
        ge=1, description="requests in the window before --cb-failure-rate applies")] = 20
    cb_cooldown_s: Annotated[float, Meta(
        gt=0, description="an open circuit lets a trial request through after this long")] = 30.0
    max_concurrent_requests: Annotated[int, Meta(
        ge=1, description="generation requests in flight at most, router-wide (more wait in the queue)")] | None = None
    rate_limit_rps: Annotated[float, Meta(
        gt=0, description="new generation requests a second at most, router-wide")] | None = None
    rate_limit_burst: Annotated[int, Meta(
        ge=1, description="requests the rate limit admits at once after idling (default: ceil(rate))")] | None = None
    queue_size: Annotated[int, Meta(
        ge=0, description="requests waiting for room under a limit at most (more: 429)")] = 100
    queue_timeout_s: Annotated[float, Meta(
        gt=0, description="seconds a request waits for room at most (then 429)")] = 30.0

    def __post_init__(self) -> None:
        check_router(self)

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * (1 << 20))

    @property
    def routing_defaults(self) -> RoutingSettings:
        return RoutingSettings(self.routing, self.cache_threshold, self.balance_abs_threshold,
                               self.balance_rel_threshold, self.max_prefix_chars)


class SloSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    ttft_ms: Annotated[float, Meta(gt=0)] | None = None
    tpot_ms: Annotated[float, Meta(gt=0)] | None = None  # also the inter-token (TBT) bound


class WorkerSpec(msgspec.Struct, forbid_unknown_fields=True):
    id: str | None = None
    device: str | None = None
    role: Role = "serve"
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    args: dict[str, Any] = msgspec.field(default_factory=dict)  # any other ServerArgs field
    # set in this worker's environment only (e.g. CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: its SM share under MPS)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    url: str | None = None  # a server reached over HTTP instead of a process started here (router/upstream/)
    upstream: UpstreamSpec | None = None  # a `url:` worker's settings


class ModelSpec(msgspec.Struct, forbid_unknown_fields=True):
    name: str | None = None  # the `model` clients send; default: basename of model_path, or "default"
    model_path: str | None = None  # None -> the embedded default model
    replicas: int = 1  # used when `workers` is omitted
    args: dict[str, Any] = msgspec.field(default_factory=dict)  # ServerArgs shared by its workers
    workers: list[WorkerSpec] | None = None
    slo: SloSpec | None = None
    limits: LimitSpec | None = None  # admission limits of this model's requests (router/resilience/)
    routing: PolicyName | None = None  # default: the router's `routing`
    cache_aware: CacheAwareSpec | None = None  # overrides of the router's cache_aware settings


class OffloadSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename={"from_": "from"}):
    """One `offload:` entry: workers of model `from` send a share of their decoding requests'
    attention and KV to an executor hosted by a worker of model `to` (one with executor_mem_gb > 0);
    the share is `policy`'s: fixed (`ratio`), adrenaline (a bound from memory, bandwidth and B_max)
    or adaptive (moved to keep `to`'s P99 TPOT within its SLO). See docs/configuration.md."""

    from_: str
    to: str
    ratio: float | None = None  # fixed: the share (required); adaptive: the starting share
    policy: str = "fixed"
    timeout_s: Annotated[float, Meta(gt=0)] = 5.0  # a data-plane wait longer than this: the executor is lost
    max_ratio: float | None = None  # adrenaline, adaptive: the largest share (default 1)
    executor_low_mem: Annotated[float, Meta(ge=0, lt=1)] = 0.1  # free executor KV below this share: "memory low"
    adrenaline: AdrenalineSpec | None = None  # policy adrenaline's settings (defaults when omitted)
    adaptive: AdaptiveSpec | None = None  # policy adaptive's settings (defaults when omitted)

    @property
    def cap(self) -> float:
        """The largest share the policy may give (fixed: its ratio)."""
        if self.policy == "fixed":
            return self.ratio or 0.0
        return self.max_ratio if self.max_ratio is not None else 1.0

    @property
    def start(self) -> float:
        """The share a new pairing starts with (adrenaline: its cap; the bound then decides)."""
        if self.policy == "adaptive":
            return self.ratio if self.ratio is not None else min(ADAPTIVE_START, self.cap)
        return self.cap


class ClusterSpec(msgspec.Struct, forbid_unknown_fields=True):
    models: list[ModelSpec]
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    offload: list[OffloadSpec] = msgspec.field(default_factory=list)
    api_keys: list[ApiKeySpec] = msgspec.field(default_factory=list)  # keys from env / files, with limits


@dataclass(frozen=True)
class LocalWorker:
    """A worker process the launcher starts: its id, role and full server arguments."""

    worker_id: str
    model: str
    role: str
    args: ServerArgs
    env: tuple[tuple[str, str], ...] = ()  # added to the launcher's environment (a tuple: hashable)


@dataclass(frozen=True)
class Cluster:
    router: RouterConfig
    workers: tuple[LocalWorker, ...]
    models: tuple[str, ...] = ()  # served names in file order, including models without local workers
    slo: Mapping[str, SloSpec] = field(default_factory=dict)  # per model name
    offload: tuple[OffloadSpec, ...] = ()
    limits: Mapping[str, LimitSpec] = field(default_factory=dict)  # per model name (the models' `limits:`)
    api_keys: tuple[ApiKey, ...] = ()  # resolved: the secrets are read at start
    routing: Mapping[str, RoutingSettings] = field(default_factory=dict)  # per model name
    upstreams: tuple[UrlWorker, ...] = ()  # `url:` workers
    # The environment variables the router reads keys from (`api_keys[].key_env`, `url:` workers'
    # `upstream.api_key_env`): taken out of every worker's environment, like $SGLANG_EXT_API_KEY.
    key_vars: tuple[str, ...] = ()


def model_name(model_path: str | None, served_model_name: str | None = None) -> str:
    """The name a worker reports (kept in step with `Worker.info`)."""
    if served_model_name:
        return served_model_name
    return "default" if not model_path else str(model_path).rstrip("/").split("/")[-1]


def router_config(values: dict[str, Any], where: str = "router") -> RouterConfig:
    """Strictly typed settings from plain values (launcher flags), with errors that name the field."""
    try:
        return msgspec.convert(values, RouterConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{where}: {e}") from None


def flag_name(field_name: str) -> str:
    """`heartbeat_timeout_s` -> `--heartbeat-timeout` (the help text says the unit)."""
    return "--" + field_name.removesuffix("_s").replace("_", "-")


def _cli_type(tp: Any) -> tuple[type, str]:
    """The argparse type and help text of a RouterConfig field's annotation."""
    help_text = ""
    # Annotated[T | None, Meta] or Annotated[T, Meta] | None: unwrap both, in either order.
    while get_origin(tp) in (Annotated, Union, types.UnionType):
        if get_origin(tp) is Annotated:
            tp, *metas = get_args(tp)
            help_text = next((m.description for m in metas if isinstance(m, Meta) and m.description), help_text)
        else:
            tp = next(a for a in get_args(tp) if a is not type(None))
    return tp, help_text


def add_router_flags(group: argparse._ArgumentGroup) -> None:
    """One launcher flag per RouterConfig field (except those the server flags carry)."""
    for f in msgspec.structs.fields(RouterConfig):
        if f.name in SERVER_FLAG_FIELDS:
            continue
        tp, help_text = _cli_type(f.type)
        flag = flag_name(f.name)
        group.add_argument(flag, dest=f.name, type=tp, default=f.default, metavar=flag[2:].upper().replace("-", "_"),
                           help=f"{help_text} (default: {f.default})")


def router_flag_values(ns: argparse.Namespace) -> dict[str, Any]:
    """The RouterConfig fields among parsed launcher flags (server flags included)."""
    return {f.name: getattr(ns, f.name) for f in msgspec.structs.fields(RouterConfig) if hasattr(ns, f.name)}


def resolve_api_key(cfg: RouterConfig, environ: Mapping[str, str] | None = None) -> RouterConfig:
    """The key from `api_key`, else from `api_key_file`, else from $SGLANG_EXT_API_KEY in `environ`
    (default: this process's environment), else none."""
    if cfg.api_key is not None and cfg.api_key_file is not None:
        raise ConfigError("give the API key once: api_key (--api-key) or api_key_file (--api-key-file), not both")
    key = cfg.api_key
    if cfg.api_key_file is not None:
        try:
            key = read_key_file(cfg.api_key_file)
        except OSError as e:
            raise ConfigError(f"cannot read the API key file: {e}") from None
        if not key:
            raise ConfigError(f"the API key file {cfg.api_key_file} is empty")
    elif key is None:
        key = API_KEY.get(environ)
    if key is not None and not key.strip():
        raise ConfigError("the API key must not be empty")
    return msgspec.structs.replace(cfg, api_key=key)


def _server_args(where: str, values: dict[str, Any]) -> ServerArgs:
    for bad in ("host", "port", "api_key"):
        if bad in values:
            raise ConfigError(f"{where}: {bad!r} belongs in the router section, not in a worker's arguments")
    try:
        return ServerArgs.from_kwargs(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def build_cluster(spec: ClusterSpec) -> Cluster:
    if not spec.models:
        raise ConfigError("models: list at least one model")
    workers: list[LocalWorker] = []
    upstreams: list[UrlWorker] = []
    names: list[str] = []
    slo: dict[str, SloSpec] = {}
    limits: dict[str, LimitSpec] = {}
    routing: dict[str, RoutingSettings] = {}
    for i, m in enumerate(spec.models):
        where = f"models[{i}]"
        name = model_name(m.model_path, m.name or m.args.get("served_model_name"))
        if name in names:
            raise ConfigError(f"{where}: model name {name!r} is used twice; set distinct `name`s")
        names.append(name)
        if m.slo is not None:
            slo[name] = m.slo
        if m.limits is not None:
            limits[name] = m.limits
        try:
            routing[name] = model_routing(where, spec.router.routing_defaults, m.routing, m.cache_aware)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if m.replicas < 0:
            raise ConfigError(f"{where}.replicas must be >= 0, got {m.replicas}")
        specs = m.workers if m.workers is not None else [WorkerSpec() for _ in range(m.replicas)]
        for j, w in enumerate(specs):
            if w.url is not None or w.upstream is not None:
                upstreams.append(_url_worker(f"{where}.workers[{j}]", w, w.id or f"{name}-{j}", name))
                continue
            # The model's SLOs are its workers' (lvf schedules by them) unless a worker's args say otherwise.
            values = {**_slo_args(m.slo), **m.args, "model_path": m.model_path, "served_model_name": name}
            for key in ("device", "mem_fraction_static", "max_total_tokens"):
                if getattr(w, key) is not None:
                    values[key] = getattr(w, key)
            values.update(w.args)
            role = _disagg_role(f"{where}.workers[{j}]", w.role, values)
            args = _server_args(f"{where}.workers[{j}]", values)
            workers.append(LocalWorker(w.id or f"{name}-{j}", name, role, args, tuple(w.env.items())))
    ids = [w.worker_id for w in workers] + [u.worker_id for u in upstreams]
    dup = sorted({x for x in ids if ids.count(x) > 1})
    if dup:
        raise ConfigError(f"worker ids must be unique, repeated: {', '.join(dup)}")
    _check_offload(spec.offload, names, workers, slo)
    try:
        api_keys = resolve_api_keys(spec.api_keys)
    except SpecError as e:
        raise ConfigError(str(e)) from None
    key_vars = [k.key_env for k in spec.api_keys if k.key_env is not None]
    key_vars += [u.spec.api_key_env for u in upstreams if u.spec.api_key_env is not None]
    return Cluster(spec.router, tuple(workers), tuple(names), slo, tuple(spec.offload), limits=limits,
                   api_keys=api_keys, routing=routing, upstreams=tuple(upstreams),
                   key_vars=tuple(dict.fromkeys(key_vars)))


def _url_worker(where: str, w: WorkerSpec, worker_id: str, model: str) -> UrlWorker:
    """A `url:` worker: a server running elsewhere, so none of the keys that start a process apply."""
    if w.url is None:
        raise ConfigError(f"{where}.upstream: settings of a `url:` worker, but the worker has no url")
    started = [k for k in ("device", "mem_fraction_static", "max_total_tokens") if getattr(w, k) is not None]
    started += [k for k in ("args", "env") if getattr(w, k)]
    if w.role != "serve":
        started.append("role")
    if started:
        raise ConfigError(f"{where}: {', '.join(started)} configure a worker process started here; a `url:` "
                          "worker runs elsewhere (configure it there)")
    try:
        return url_worker(where, worker_id, model, w.url, w.upstream)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _disagg_role(where: str, role: str, values: dict[str, Any]) -> str:
    """`role: prefill|decode` is the worker's disaggregation_mode (and a worker whose args set that
    mode has that role); the two must not disagree."""
    mode = values.get("disaggregation_mode")
    if role in ("prefill", "decode"):
        if mode is not None and mode != role:
            raise ConfigError(f"{where}: role {role!r} but disaggregation_mode {mode!r}; give one of them")
        values["disaggregation_mode"] = role
        return role
    if mode is not None and role != "serve":
        raise ConfigError(f"{where}: role {role!r} cannot also be a {mode} worker (disaggregation_mode)")
    return str(mode) if mode is not None else role


def _slo_args(slo: SloSpec | None) -> dict[str, float]:
    if slo is None:
        return {}
    pairs = (("ttft_slo_ms", slo.ttft_ms), ("tpot_slo_ms", slo.tpot_ms))
    return {k: v for k, v in pairs if v is not None}


def _check_policy(where: str, o: OffloadSpec, slo: Mapping[str, SloSpec]) -> None:
    if o.policy not in OFFLOAD_POLICIES:
        raise ConfigError(f"{where}.policy: {o.policy!r} is not one of {', '.join(OFFLOAD_POLICIES)}")
    for key in ("adrenaline", "adaptive"):
        if getattr(o, key) is not None and o.policy != key:
            raise ConfigError(f"{where}.{key}: settings of policy {key}, but the policy is {o.policy}")
    if o.policy == "fixed":
        if o.ratio is None:
            raise ConfigError(f"{where}.ratio: policy fixed needs a ratio, in (0, 1]")
        if o.max_ratio is not None:
            raise ConfigError(f"{where}.max_ratio: for policies adrenaline and adaptive; fixed uses ratio")
    elif o.policy == "adrenaline" and o.ratio is not None:
        raise ConfigError(f"{where}.ratio: policy adrenaline derives the share from its bound; "
                          "cap it with max_ratio")
    if o.max_ratio is not None and not 0.0 < o.max_ratio <= 1.0:
        raise ConfigError(f"{where}.max_ratio must be in (0, 1], got {o.max_ratio}")
    hi = 1.0 if o.policy == "fixed" else o.cap
    if o.ratio is not None and not 0.0 < o.ratio <= hi:
        bound = "(0, 1]" if o.policy == "fixed" else f"(0, max_ratio {hi:g}]"
        raise ConfigError(f"{where}.ratio must be in {bound}, got {o.ratio}")
    if o.policy == "adaptive" and (o.to not in slo or slo[o.to].tpot_ms is None):
        raise ConfigError(f"{where}: policy adaptive keeps {o.to!r}'s P99 TPOT within its SLO: "
                          f"set slo: {{tpot_ms: ...}} on model {o.to!r}")


def _check_offload(rules: list[OffloadSpec], names: list[str], workers: list[LocalWorker],
                   slo: Mapping[str, SloSpec]) -> None:
    """Pairings that cannot work are errors at start. (A `to` model without local workers is checked
    when its workers join: they may offer executor memory from another host.)"""
    senders: set[str] = set()
    for i, o in enumerate(rules):
        where = f"offload[{i}]"
        for key, name in (("from", o.from_), ("to", o.to)):
            if name not in names:
                raise ConfigError(f"{where}.{key}: no model named {name!r} (models: {', '.join(names)})")
        adrenaline = o.from_ == o.to
        if adrenaline:
            roles = {w.role for w in workers if w.model == o.to}
            if not {"prefill", "decode"} <= roles:
                raise ConfigError(f"{where}: from and to are both {o.to!r}: that is Adrenaline placement, which "
                                  f"needs prefill and decode workers of {o.to!r} (role: prefill|decode; it has "
                                  f"{', '.join(sorted(roles)) or 'no local workers'}); otherwise a model "
                                  "offloads to another model")
        _check_policy(where, o, slo)
        if o.from_ in senders:
            raise ConfigError(f"{where}: model {o.from_!r} already offloads (one entry per `from` model)")
        senders.add(o.from_)
        # Adrenaline placement: the prefill workers host the executors
        hosts = [w for w in workers if w.model == o.to and (not adrenaline or w.role == "prefill")]
        if hosts and not any(w.args.executor_mem_gb > 0 and w.args.offload_executor is None for w in hosts):
            which = "prefill worker" if adrenaline else "worker"
            raise ConfigError(f"{where}: no {which} of {o.to!r} offers executor memory; set executor_mem_gb (GiB) "
                              f"in its args or a worker's args")
        for w in workers:
            if w.model != o.from_ or (adrenaline and w.role != "decode"):
                continue
            if w.args.offload_executor is not None:
                raise ConfigError(f"{where}: worker {w.worker_id} of {o.from_!r} has an in-process executor "
                                  "(offload_executor); drop it or this entry")
            try:
                check_served(w.args.offload_transport)
            except ValueError as e:
                raise ConfigError(f"{where}: worker {w.worker_id}: {e}") from None


def load_cluster(path: str | Path) -> Cluster:
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    try:
        spec = msgspec.convert(raw, ClusterSpec)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {e}") from None
    return build_cluster(spec)
