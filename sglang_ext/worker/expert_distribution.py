"""One worker's side of SGLang's expert distribution recorder (--expert-distribution-recorder-mode stat).

The model counts routed tokens for as long as the mode is on (models/expert_counts.py): the adds are
captured in the decode CUDA graphs, which cannot skip them on some replays and not others. So a record
is a difference of snapshots, taken between steps on the forward thread:

    start   baseline = a host copy of the counts              (again while recording: a fresh start)
    stop    record = counts now - baseline                    (nothing recording: refused)
    dump    the record (while recording: counts now - baseline) written to
            DIR/expert_distribution_recorder_<worker>_<unix ms>.pt    torch.save of a dict of CPU tensors
            DIR/expert_distribution_recorder_<worker>_<unix ms>.json  the same as plain lists

DIR is the latest `output_dir` a request gave, else $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else /tmp.
<worker> is the worker id with every character but letters, digits, '.', '_' and '-' made '_'
(`preset:qwen3-30b-a3b-0` -> `preset_qwen3-30b-a3b-0`). The dict's `logical_count` ([sparse layers,
experts] int64) is the name SGLang users' scripts read.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Final

import torch

from sglang_ext.env import EXPERT_DISTRIBUTION_DIR
from sglang_ext.messages import ExpertDistributionReq, ReplyOut
from sglang_ext.models.expert_counts import ExpertCounts
from sglang_ext.worker.profile import file_safe, writable_dir

MODE: Final = "stat"
PREFIX: Final = "expert_distribution_recorder"


class RecordError(ValueError):
    """A request this worker cannot serve (answered ok=False, a 400 at the router)."""


class ExpertDistributionRecorder:
    """Start / stop / dump over the model's counts; `counts` None answers every request with `unavailable`."""

    def __init__(self, counts: ExpertCounts | None, worker: str, model: str, unavailable: str = "") -> None:
        self.counts, self.worker, self.model, self.unavailable = counts, worker, model, unavailable
        self.baseline: torch.Tensor | None = None  # set while recording
        self.record: torch.Tensor | None = None  # the last stopped record
        self.started_at = self.stopped_at = 0.0
        self.out: Path | None = None  # the latest output_dir given

    @property
    def recording(self) -> bool:
        return self.baseline is not None

    def handle(self, msg: ExpertDistributionReq) -> ReplyOut:
        try:
            if self.counts is None:
                raise RecordError(self.unavailable)
            if msg.output_dir:
                self.out = writable_dir(Path(msg.output_dir).expanduser(), RecordError)
            files: list[Path] = []
            if msg.action == "start":
                message = self.start()
            elif msg.action == "stop":
                message = self.stop()
            else:
                files = self.dump()
                message = f"{self.worker}: expert distribution written to {files[0]}"
        except RecordError as e:
            return ReplyOut(rid=msg.rid, ok=False, data={"error": f"{self.worker}: {e}", "status": 400})
        return ReplyOut(rid=msg.rid, ok=True, data={"message": message, "files": [str(f) for f in files]})

    def start(self) -> str:
        assert self.counts is not None
        again = self.recording
        self.baseline, self.record = self.counts.snapshot(), None
        self.started_at = time.time()
        return f"{self.worker}: recording the expert distribution" + (" afresh (the record so far is dropped)"
                                                                       if again else "")

    def stop(self) -> str:
        if self.baseline is None:
            raise RecordError("the expert distribution is not being recorded: POST /start_expert_distribution_record "
                              "first")
        self.record, self.baseline = self._since_start(), None
        self.stopped_at = time.time()
        return f"{self.worker}: recorded {self._tokens(self.record)} tokens' routing"

    def dump(self) -> list[Path]:
        """Write the record (up to now while recording); the .pt file's path first."""
        if self.recording:
            counts, end = self._since_start(), time.time()
        elif self.record is not None:
            counts, end = self.record, self.stopped_at
        else:
            raise RecordError("nothing was recorded: POST /start_expert_distribution_record first")
        out = self.out or writable_dir(EXPERT_DISTRIBUTION_DIR.get() or Path("/tmp"), RecordError)
        stem = f"{PREFIX}_{file_safe(self.worker)}_{int(time.time() * 1000)}"
        data = self.contents(counts, end)
        pt, js = out / f"{stem}.pt", out / f"{stem}.json"
        try:
            torch.save(data, pt)
            js.write_text(json.dumps({**data, "logical_count": counts.tolist()}))
        except OSError as e:
            raise RecordError(f"the expert distribution cannot be written to {str(out)!r}: {e}") from None
        return [pt, js]

    def contents(self, counts: torch.Tensor, end: float) -> dict[str, Any]:
        assert self.counts is not None
        return {"logical_count": counts, "layers": list(self.counts.layers), "num_experts": self.counts.num_experts,
                "top_k": self.counts.top_k, "tokens": self._tokens(counts), "model": self.model,
                "worker": self.worker, "mode": MODE, "recording": self.recording, "start_time": self.started_at,
                "end_time": end}

    def _since_start(self) -> torch.Tensor:
        assert self.counts is not None and self.baseline is not None
        return self.counts.snapshot() - self.baseline

    def _tokens(self, counts: torch.Tensor) -> int:
        """Tokens routed: a row's sum / top_k (every layer sees every token)."""
        assert self.counts is not None
        return int(counts[0].sum()) // self.counts.top_k if counts.shape[0] else 0


def make_recorder(counts: ExpertCounts | None, moe: bool, worker: str, model: str) -> ExpertDistributionRecorder:
    """The worker's recorder; without counts it says why: a dense model, or a server started without the mode
    (a dense model with the mode never starts: worker.py refuses it, as --moe-routing-simulation)."""
    why = ""
    if counts is None:
        why = (f"model {model!r} has no MoE layers: there is no expert distribution to record" if not moe else
               "this server was started without --expert-distribution-recorder-mode: start it with "
               "--expert-distribution-recorder-mode stat to record the expert distribution")
    return ExpertDistributionRecorder(counts, worker, model, why)
