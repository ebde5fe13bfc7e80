"""A torch.profiler window over a worker's steps: at startup (flags) or on demand (/start_profile).

    --profile-dir DIR [--profile-start-step START] [--profile-num-steps STEPS]
        profile steps START .. START+STEPS-1 (steps with work, counted from the worker's start; defaults
        0 and 10), then write DIR/<worker id>.txt (the ops by self device time, then by self CPU time)
        and DIR/<worker id>.trace.json (a Chrome trace). Taken once.

    ProfileReq start (POST /start_profile {output_dir?, num_steps?, activities?})
        profile from now on, into output_dir (default $SGLANG_TORCH_PROFILER_DIR, else /tmp), until a
        ProfileReq stop, or by itself after num_steps steps with work; the files are named
        <worker id>-<unix ms>.txt / .trace.json, so that profiles taken one after another do not overwrite.

Both are one `StepProfiler`; without either, nothing of torch.profiler is imported.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from sglang_ext.env import PROFILER_DIR
from sglang_ext.messages import ProfileReq, ReplyOut

if TYPE_CHECKING:
    from sglang_ext.server_args import ServerArgs

logger = logging.getLogger(__name__)
TOP: Final = 40
ACTIVITIES: Final = ("CPU", "GPU")  # "CUDA" is taken for "GPU"


class ProfileError(ValueError):
    """A profile request that cannot be served here (answered ok=False, a 400 at the router)."""


def make_profiler(args: ServerArgs, name: str, cuda: bool) -> StepProfiler | None:
    """The worker's startup window, None without `profile_dir`."""
    if args.profile_dir is None:
        return None
    return StepProfiler(Path(args.profile_dir), name, cuda, start=args.profile_start_step,
                        steps=args.profile_num_steps)


class StepProfiler:
    """Profiles steps `start` .. `start + steps - 1` of those it is shown (every step when `steps` is
    None, until `stop`), then writes `<stem>.txt` and `<stem>.trace.json` into `out`."""

    def __init__(self, out: Path, name: str, cuda: bool, start: int = 0, steps: int | None = None,
                 stem: str | None = None, activities: tuple[str, ...] | None = None) -> None:
        self.out, self.name, self.cuda, self.start, self.steps = out, name, cuda, start, steps
        self.stem = file_safe(stem or name)
        self.activities = activities or (("CPU", "GPU") if cuda else ("CPU",))
        self.seen = 0
        self._prof: Any = None
        self.done = False
        self.files: list[Path] = []

    @property
    def active(self) -> bool:
        return self._prof is not None

    def begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        kinds = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA}
        self._prof = profile(activities=[kinds[a] for a in self.activities])
        self._prof.__enter__()
        last = "stop" if self.steps is None else str(self.start + self.steps - 1)
        logger.info("%s: profiling steps %d..%s (%s)", self.name, self.start, last, "+".join(self.activities))

    def before_step(self) -> None:
        if not self.done and self._prof is None and self.seen == self.start:
            self.begin()

    def after_step(self) -> None:
        self.seen += 1
        if self._prof is not None and self.steps is not None and self.seen >= self.start + self.steps:
            self.stop()

    def stop(self) -> list[Path]:
        """End the window now and write its files (their paths)."""
        prof, self._prof, self.done = self._prof, None, True
        if prof is None:
            return []
        prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        avg = prof.key_averages()
        device_key = "self_device_time_total" if "GPU" in self.activities else "self_cpu_time_total"
        window = f"steps {self.start}..{self.seen - 1}" if self.seen > self.start else "no steps"
        text = (f"# {self.name}: {window}\n\n"
                f"## by self device time\n{avg.table(sort_by=device_key, row_limit=TOP)}\n\n"
                f"## by self CPU time\n{avg.table(sort_by='self_cpu_time_total', row_limit=TOP)}\n")
        txt, trace = self.out / f"{self.stem}.txt", self.out / f"{self.stem}.trace.json"
        txt.write_text(text)
        prof.export_chrome_trace(str(trace))
        self.files = [trace, txt]
        logger.info("%s: profile written to %s", self.name, trace)
        return self.files


def on_demand(msg: ProfileReq, current: StepProfiler | None, name: str, cuda: bool) -> tuple[StepProfiler | None,
                                                                                               ReplyOut]:
    """A ProfileReq against the worker's profiler `current`: the profiler from now on, and the answer."""
    try:
        if msg.action == "stop":
            if current is None or not current.active:
                raise ProfileError("the profiler is not running: POST /start_profile first "
                                   "(a start with num_steps stops by itself)")
            files = current.stop()
            return current, ReplyOut(rid=msg.rid, ok=True, data={
                "message": f"{name}: profile written to {files[0]}", "files": [str(f) for f in files]})
        if current is not None and current.active:
            raise ProfileError("the profiler is already running: POST /stop_profile first")
        prof = _new(msg, name, cuda)
        prof.begin()
    except ProfileError as e:
        return current, ReplyOut(rid=msg.rid, ok=False, data={"error": f"{name}: {e}"})
    until = "stop_profile" if prof.steps is None else f"{prof.steps} steps"
    return prof, ReplyOut(rid=msg.rid, ok=True, data={
        "message": f"{name}: profiling into {prof.out} until {until}", "files": []})


def _new(msg: ProfileReq, name: str, cuda: bool) -> StepProfiler:
    if msg.num_steps is not None and msg.num_steps < 1:
        raise ProfileError(f"num_steps must be >= 1, got {msg.num_steps}")
    acts: list[str] = []
    for a in msg.activities:
        a = "GPU" if a.upper() == "CUDA" else a.upper()
        if a not in ACTIVITIES:
            raise ProfileError(f"activities: {a!r} is not supported (one of: CPU, GPU)")
        if a == "GPU" and not cuda:
            raise ProfileError("activities: GPU was asked, but this worker runs on a CPU")
        if a not in acts:
            acts.append(a)
    out = writable_dir(Path(msg.output_dir).expanduser() if msg.output_dir else (PROFILER_DIR.get() or Path("/tmp")),
                       ProfileError)
    return StepProfiler(out, name, cuda, steps=msg.num_steps, stem=f"{name}-{int(time.time() * 1000)}",
                        activities=tuple(acts) or None)


def file_safe(name: str) -> str:
    """A worker id as part of a file name: `preset:qwen3-30b-a3b-0` -> `preset_qwen3-30b-a3b-0`. A ':' or
    '/' in a name (a preset model path) makes files that copy tools and other systems refuse (2026-12-07:
    the device tool did not bring back a dump named after `preset:...`)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def writable_dir(out: Path, error: type[ValueError]) -> Path:
    """`out`, created if missing; `error` (the caller's refusal, a 400 at the router) when it cannot be
    created or written (an admin endpoint's `output_dir`: the profiler's, the expert recorder's)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise error(f"output_dir {str(out)!r} cannot be created: {e}") from None
    if not os.access(out, os.W_OK):
        raise error(f"output_dir {str(out)!r} is not writable")
    return out
