"""When a failed request is tried again, and how long the router waits first.

A request is retried only while its client has seen nothing of it (the core checks that: nothing
streamed, or a non-streaming request whose partial output is discarded), only for failures of the
worker -- it died, went silent, restarted, could not be reached, or said so with a 502/503/504 --
and never for the client's own errors (4xx): another worker would refuse the same request the same way.
A 500 is a failure of this one request on that worker (a tokenizer that threw): not retried either.

Waits grow exponentially, with jitter so that the requests of a worker that died together do not all
land on the next worker in the same instant: wait(n) = min(max, base * multiplier**(n-1)) * (1 ± jitter).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Final

RETRYABLE_STATUS: Final = frozenset({502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 2
    backoff_s: float = 0.05
    backoff_max_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait before retry number `attempt` (1 for the first)."""
        base = min(self.backoff_max_s, self.backoff_s * self.multiplier ** max(0, attempt - 1))
        return max(0.0, base * (1.0 + rng.uniform(-self.jitter, self.jitter)))

    @staticmethod
    def retryable(status: int) -> bool:
        """Whether a worker's explicit error status is worth another attempt."""
        return status in RETRYABLE_STATUS
