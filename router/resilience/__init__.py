"""Resilience of the router: retries with backoff, per-worker circuit breakers, and admission limits
(router-wide, per model, per API key) with a bounded wait queue.

    backoff    the retry policy (exponential backoff with jitter, which failures are retried)
    breaker    a circuit breaker per worker (closed -> open -> half-open -> closed)
    limiter    a concurrency and/or rate limit with a bounded FIFO wait queue (429 + Retry-After)
    admission  the limits that apply to an HTTP request, and their release when its exchange ends
    metrics    their Prometheus series
    hub        `Resilience`: all of the above for one Router (`router.resilience`)

The cluster file's `limits:` / `api_keys:` entries (and resolving keys from env / files) are read by
router/limit_spec.py, below both this package and router/config.py, which imports it. This package's
__init__ imports nothing, so importing one of its modules loads only what that module needs.
"""
