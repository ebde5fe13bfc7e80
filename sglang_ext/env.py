"""The environment variables sglang_ext reads, each typed and documented in one place.

What a server does is set by its server arguments and the cluster file; the environment says only
where things live and carries secrets that must stay out of the process list. A variable is read
when asked (not at import), so a test or a launcher can set it first; unset and empty are the same.
docs/configuration.md lists every variable of `ALL`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One variable: its name, what it means (and what applies when it is unset), and its parser."""

    name: str
    help: str
    parse: Callable[[str], T]
    # The router's alone (a secret): never in a worker's environment (`worker_environ`).
    router_only: bool = False
    # SGLang's own name, kept so an SGLang user's setup carries over (else the name starts SGLANG_EXT_).
    sglang_name: bool = False

    def get(self, environ: Mapping[str, str] | None = None) -> T | None:
        """The parsed value from `environ` (default: this process's environment); None when unset or empty."""
        raw = (os.environ if environ is None else environ).get(self.name, "")
        return self.parse(raw) if raw else None


CACHE: Final = EnvVar(
    "SGLANG_EXT_CACHE",
    "directory where the embedded default model and preset directories are built (unset: ~/.cache/sglang_ext)",
    lambda s: Path(s).expanduser())
API_KEY: Final = EnvVar(
    "SGLANG_EXT_API_KEY",
    "the launcher's API key when neither --api-key nor --api-key-file (router api_key / api_key_file) gives "
    "one; keeps the key out of the process list (unset: no key); never passed on to workers",
    str, router_only=True)

PROFILER_DIR: Final = EnvVar(
    "SGLANG_TORCH_PROFILER_DIR",
    "where /start_profile writes its trace when the request names no output_dir "
    "(SGLang's variable; unset: /tmp)",
    lambda s: Path(s).expanduser(), sglang_name=True)

EXPERT_DISTRIBUTION_DIR: Final = EnvVar(
    "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR",
    "where /dump_expert_distribution_record writes its files when no request named an output_dir "
    "(SGLang's variable; unset: /tmp)",
    lambda s: Path(s).expanduser(), sglang_name=True)

ALL: Final[tuple[EnvVar[Any], ...]] = (CACHE, API_KEY, PROFILER_DIR, EXPERT_DISTRIBUTION_DIR)


def worker_environ(extra: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None,
                   secrets: Iterable[str] = ()) -> dict[str, str]:
    """The environment of a worker process: `environ` (default: this process's) with `extra` (a worker's
    `env:` in the cluster file) added, less every router-only variable and every variable named in
    `secrets` (those a cluster file names as holding a key: `api_keys[].key_env`, a `url:` worker's
    `upstream.api_key_env`). A child inherits its parent's environment whole, and a worker needs none of
    the router's secrets: there they would be readable in /proc/PID/environ, in its crash reports, and
    by whatever it starts (compilers, tokenizer downloads). Dropped even when `extra` names them: no
    worker reads them."""
    env = {**(os.environ if environ is None else environ), **(extra or {})}
    for name in (*(var.name for var in ALL if var.router_only), *secrets):
        env.pop(name, None)
    return env


__all__ = ["ALL", "API_KEY", "CACHE", "EXPERT_DISTRIBUTION_DIR", "PROFILER_DIR", "EnvVar", "worker_environ"]
