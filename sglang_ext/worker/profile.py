"""A torch.profiler window over a worker's steps, for one serving run.

    --profile-dir DIR [--profile-start-step START] [--profile-num-steps STEPS]
        profile steps START .. START+STEPS-1 (steps with work, counted from the worker's start; defaults
        0 and 10), then write DIR/<worker id>.txt (the ops by self device time, then by self CPU time)
        and DIR/<worker id>.trace.json (a Chrome trace)

No --profile-dir: off, and nothing is imported. The window is taken once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from sglang_ext.server_args import ServerArgs

logger = logging.getLogger(__name__)
TOP: Final = 40


def make_profiler(args: ServerArgs, name: str, cuda: bool) -> StepProfiler | None:
    """The worker's profiler window, None without `profile_dir`."""
    if args.profile_dir is None:
        return None
    return StepProfiler(args.profile_start_step, args.profile_num_steps, Path(args.profile_dir), name, cuda)


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
