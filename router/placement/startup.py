"""How loud a pairing that waits for its peer should be: quiet while the cluster starts.

On every start the workers come up one by one, so a sender (or a decode worker) is often up before the
worker that will host its executor: its pairing waits, as expected, and a WARNING there would be noise
that teaches operators to ignore the real ones. A wait is only worth a warning once it is no longer the
startup's: a host of that model was up before (it is gone now), or the router started more than
STARTUP_GRACE_S ago and none of the launcher's workers of that model is still on its first start (a
large model may take minutes to load: its first start is the startup, however long).
"""

from __future__ import annotations

import logging
import time
from typing import Final

from router.registry import Registry

STARTUP_GRACE_S: Final = 60.0  # for hosts that join by themselves (the launcher's own are followed by state)


class StartupQuiet:
    def __init__(self, registry: Registry, grace_s: float = STARTUP_GRACE_S) -> None:
        self.registry = registry
        self.grace_s = grace_s
        self.born = time.monotonic()
        self.hosts_seen: set[str] = set()  # models one of whose hosts was up once

    def host_up(self, model: str) -> None:
        self.hosts_seen.add(model)

    def starting(self, model: str) -> bool:
        """Whether a wait for a host of `model` is still part of the startup."""
        if model in self.hosts_seen:
            return False
        if time.monotonic() - self.born < self.grace_s:
            return True
        entry = self.registry.models.get(model)
        for w in entry.workers.values() if entry else ():
            sup = w.supervision
            if sup is not None and not w.up and not sup.ever_up and sup.restarts == 0 and sup.state == "running":
                return True  # still loading for the first time
        return False

    def level(self, model: str) -> int:
        """The log level of a wait for a host of `model`."""
        return logging.INFO if self.starting(model) else logging.WARNING
