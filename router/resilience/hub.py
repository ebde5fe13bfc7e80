"""`Resilience`: the retry policy, the workers' circuit breakers and the admission limits of one
Router, made from its settings (router.config.RouterConfig), the models' `limits:` and the API keys."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry

from router.config import RouterConfig
from router.limit_spec import PRIMARY_KEY_NAME, ApiKey, LimitSpec
from router.resilience.admission import Admission
from router.resilience.backoff import RetryPolicy
from router.resilience.breaker import BreakerPolicy, Breakers
from router.resilience.metrics import ResilienceMetrics
from router.tracker import WorkerState


def router_limits(cfg: RouterConfig) -> LimitSpec:
    """The router-wide limit, and the queue defaults of the others, from the router's settings."""
    return LimitSpec(max_concurrent=cfg.max_concurrent_requests, rate_rps=cfg.rate_limit_rps,
                     burst=cfg.rate_limit_burst, queue_size=cfg.queue_size, queue_timeout_s=cfg.queue_timeout_s)


class Resilience:
    def __init__(self, cfg: RouterConfig, registry: CollectorRegistry,
                 workers: Callable[[], Iterable[WorkerState]] = tuple,
                 limits: Mapping[str, LimitSpec] | None = None, api_keys: Sequence[ApiKey] = (),
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.retry = RetryPolicy(cfg.max_retries, cfg.retry_backoff_s, cfg.retry_backoff_max_s,
                                 cfg.retry_backoff_multiplier, cfg.retry_jitter)
        self.breakers = Breakers(BreakerPolicy(cfg.cb_failure_threshold, cfg.cb_failure_rate, cfg.cb_window_s,
                                               cfg.cb_min_requests, cfg.cb_cooldown_s), clock)
        self.admission = Admission(router_limits(cfg), limits or {}, api_keys, clock)
        self.api_keys = tuple(api_keys)
        self.rng = rng or random.Random()
        self.metrics = ResilienceMetrics(registry, workers, self.breakers, self.admission)

    def backoff(self, attempt: int) -> float:
        return self.retry.delay(attempt, self.rng)

    def credentials(self, primary: str | None) -> list[tuple[str, str]]:
        """(name, key) of every key the router accepts: the named keys, then the primary `api_key`
        (named "default"; a named key with the same value takes precedence, with its limits)."""
        creds = [(k.name, k.secret) for k in self.api_keys]
        if primary and all(k.secret != primary for k in self.api_keys):
            creds.append((PRIMARY_KEY_NAME, primary))
        return creds
