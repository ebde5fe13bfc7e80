"""A torch.profiler window over a worker's steps, for one serving run (`SGLANG_EXT_PROFILE`).

    SGLANG_EXT_PROFILE=START:STEPS:DIR     profile steps START .. START+STEPS-1 (steps with work, counted
                                           from the worker's start), then write DIR/<worker id>.txt (the
                                           ops by self device time, then by self CPU time) and
                                           DIR/<worker id>.trace.json (a Chrome trace)

Unset: off, and nothing is imported. The window is taken once; a malformed value is reported once and
ignored (a profile must never stop a worker).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Final

logger = logging.getLogger(__name__)
ENV: Final = "SGLANG_EXT_PROFILE"
TOP: Final = 40


def window_from_env() -> tuple[int, int, Path] | None:
    raw = os.environ.get(ENV, "")
    if not raw:
        return None
    try:
        start, steps, out = raw.split(":", 2)
        window = (int(start), int(steps), Path(out))
    except ValueError:
        logger.warning("%s=%r is not START:STEPS:DIR; not profiling", ENV, raw)
        return None
    if window[0] < 0 or window[1] < 1:
        logger.warning("%s=%r: START must be >= 0 and STEPS >= 1; not profiling", ENV, raw)
        return None
    return window


class StepProfiler:
    def __init__(self, start: int, steps: int, out: Path, name: str, cuda: bool) -> None:
        self.start, self.steps, self.out, self.name, self.cuda = start, steps, out, name, cuda
        self.seen = 0
        self._prof: Any = None
        self.done = False

    def before_step(self) -> None:
        if self.done or self.seen != self.start:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        logger.info("%s: profiling steps %d..%d", self.name, self.start, self.start + self.steps - 1)

    def after_step(self) -> None:
        self.seen += 1
        if self._prof is None or self.seen < self.start + self.steps:
            return
        prof, self._prof, self.done = self._prof, None, True
        prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        avg = prof.key_averages()
        device_key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        text = (f"# {self.name}: steps {self.start}..{self.start + self.steps - 1}\n\n"
                f"## by self device time\n{avg.table(sort_by=device_key, row_limit=TOP)}\n\n"
                f"## by self CPU time\n{avg.table(sort_by='self_cpu_time_total', row_limit=TOP)}\n")
        (self.out / f"{self.name}.txt").write_text(text)
        prof.export_chrome_trace(str(self.out / f"{self.name}.trace.json"))
        logger.info("%s: profile written to %s", self.name, self.out)
