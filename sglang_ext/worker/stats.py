"""The figures of a worker's load report: latency windows for the router's planners (LoadReport.latency:
TPOT / TTFT P99, mean decode step); a per-mechanism part is None where it has nothing to report."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Final, TypeVar

from sglang_ext.messages.io import ExecutorKV, KVTransferStats, Latency, OffloadSender, RotationStats

WINDOW_S: Final = 10.0
MAX_SAMPLES: Final = 1024
DECODE_STEP_WINDOW_S: Final = 3.0  # decode step times: shorter, a step-time change shows at once


class LatencyWindow:
    """One latency over the last `window_s` (seconds): finished requests' TPOT (per output token after
    the first), first tokens' TTFT, or decode steps' wall time. Added on the forward thread, read by the
    load report's thread: guarded by a lock."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def add(self, value_s: float, now: float | None = None) -> None:
        with self._lock:
            self._samples.append((time.monotonic() if now is None else now, value_s))

    def _recent(self, now: float | None) -> list[float]:
        cut = (time.monotonic() if now is None else now) - self.window_s
        with self._lock:
            while self._samples and self._samples[0][0] < cut:
                self._samples.popleft()
            return [v for _, v in self._samples]

    def count(self, now: float | None = None) -> int:
        return len(self._recent(now))

    def p99_ms(self, now: float | None = None) -> float:
        """The nearest-rank 99th percentile in milliseconds; 0 with no samples."""
        values = sorted(self._recent(now))
        if not values:
            return 0.0
        return values[max(math.ceil(0.99 * len(values)) - 1, 0)] * 1e3

    def mean_ms(self, now: float | None = None) -> float:
        """The mean in milliseconds; 0 with no samples."""
        values = self._recent(now)
        return 1e3 * sum(values) / len(values) if values else 0.0


Part = TypeVar("Part", OffloadSender, ExecutorKV, RotationStats, KVTransferStats)


def present(part: Part) -> Part | None:
    """The part, or None when every figure is at its default (the mechanism has nothing to report)."""
    return None if part == type(part)() else part


def latency(tpot: LatencyWindow, ttft: LatencyWindow, decode_steps: LatencyWindow) -> Latency:
    return Latency(tpot_p99_ms=tpot.p99_ms(), tpot_samples=tpot.count(), ttft_p99_ms=ttft.p99_ms(),
                   ttft_samples=ttft.count(), decode_step_ms=decode_steps.mean_ms(), decode_steps=decode_steps.count())
