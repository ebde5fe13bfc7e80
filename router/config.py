"""Router settings and the cluster file (`--config cluster.yaml`) schema.

The YAML is decoded strictly into msgspec Structs: an unknown key, a wrong type or an unknown server
argument is an error that names where it is, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import msgspec

from sglang_ext.server_args import DEFAULT_PORT, ServerArgs

ROLES: Final = ("serve", "hot", "cold", "prefill", "decode")
Role = Literal["serve", "hot", "cold", "prefill", "decode"]


class ConfigError(ValueError):
    pass


class SloSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    ttft_ms: float | None = None
    tpot_ms: float | None = None  # also the inter-token (TBT) bound


class WorkerSpec(msgspec.Struct, forbid_unknown_fields=True):
    id: str | None = None
    device: str | None = None
    role: Role = "serve"
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    args: dict[str, Any] = msgspec.field(default_factory=dict)  # any other ServerArgs field


class ModelSpec(msgspec.Struct, forbid_unknown_fields=True):
    name: str | None = None  # the `model` clients send; default: basename of model_path, or "default"
    model_path: str | None = None  # None -> the embedded default model
    replicas: int = 1  # used when `workers` is omitted
    args: dict[str, Any] = msgspec.field(default_factory=dict)  # ServerArgs shared by its workers
    workers: list[WorkerSpec] | None = None
    slo: SloSpec | None = None


class RouterSpec(msgspec.Struct, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    worker_host: str = "127.0.0.1"  # where the worker-facing ZeroMQ socket binds
    worker_port: int = 0  # 0 -> a free port (printed at startup)
    api_key: str | None = None
    heartbeat_timeout_s: float = 3.0
    log_level: str = "info"


class ClusterSpec(msgspec.Struct, forbid_unknown_fields=True):
    models: list[ModelSpec]
    router: RouterSpec = msgspec.field(default_factory=RouterSpec)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    worker_host: str = "127.0.0.1"
    worker_port: int = 0
    api_key: str | None = None
    heartbeat_timeout_s: float = 3.0
    log_level: str = "info"
    slo: dict[str, SloSpec] = dataclasses.field(default_factory=dict)  # per model name

    @property
    def worker_bind_addr(self) -> str:
        return f"tcp://{self.worker_host}:{self.worker_port or '*'}"


@dataclass(frozen=True)
class LocalWorker:
    """A worker process the launcher starts: its id, role and full server arguments."""

    worker_id: str
    model: str
    role: str
    args: ServerArgs


@dataclass(frozen=True)
class Cluster:
    router: RouterConfig
    workers: tuple[LocalWorker, ...]
    models: tuple[str, ...] = ()  # served names in file order, including models without local workers


def model_name(model_path: str | None, served_model_name: str | None = None) -> str:
    """The name a worker reports (kept in step with `Worker.info`)."""
    if served_model_name:
        return served_model_name
    return "default" if not model_path else str(model_path).rstrip("/").split("/")[-1]


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
    names: list[str] = []
    slo: dict[str, SloSpec] = {}
    for i, m in enumerate(spec.models):
        where = f"models[{i}]"
        name = model_name(m.model_path, m.name or m.args.get("served_model_name"))
        if name in names:
            raise ConfigError(f"{where}: model name {name!r} is used twice; set distinct `name`s")
        names.append(name)
        if m.slo is not None:
            slo[name] = m.slo
        if m.replicas < 0:
            raise ConfigError(f"{where}.replicas must be >= 0, got {m.replicas}")
        specs = m.workers if m.workers is not None else [WorkerSpec() for _ in range(m.replicas)]
        for j, w in enumerate(specs):
            values = {**m.args, "model_path": m.model_path, "served_model_name": name}
            for key in ("device", "mem_fraction_static", "max_total_tokens"):
                if getattr(w, key) is not None:
                    values[key] = getattr(w, key)
            values.update(w.args)
            args = _server_args(f"{where}.workers[{j}]", values)
            workers.append(LocalWorker(w.id or f"{name}-{j}", name, w.role, args))
    ids = [w.worker_id for w in workers]
    dup = sorted({x for x in ids if ids.count(x) > 1})
    if dup:
        raise ConfigError(f"worker ids must be unique, repeated: {', '.join(dup)}")
    r = spec.router
    router = RouterConfig(r.host, r.port, r.worker_host, r.worker_port, r.api_key, r.heartbeat_timeout_s,
                          r.log_level, slo)
    return Cluster(router, tuple(workers), tuple(names))


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
