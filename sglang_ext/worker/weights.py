"""Reloading a worker's weights from disk in place (/update_weights_from_disk), without a restart.

    UpdateWeightsReq ──> pending ──(the scheduler drains: requests it holds finish on the old weights;
                                    new GenerateReqs wait in `held`)──> reload ──> flush the prefix cache
                     ──> ReplyOut(ok, message) ──> the held requests run on the new weights

Why drain rather than swap under running requests: a request's KV (and the prefix cache) was computed
with the old weights; mixing the two would give outputs that neither checkpoint gives. Draining keeps
every request on one set of weights, and lets the cache be dropped whole. No request fails for it.

The load copies into the existing parameters (their storage, which CUDA graphs captured, stays). A
checkpoint that does not fit (another architecture, other shapes, missing tensors, unreadable files)
is refused before anything is copied when the config says so, and otherwise by restoring a host copy
of the old weights: either way the old weights keep serving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

import torch

from sglang_ext.messages import GenerateReq, ReplyOut, UpdateWeightsReq
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.loader import init_dummy_weights, iter_safetensors
from sglang_ext.models.resolve import resolve_model_path

if TYPE_CHECKING:
    from sglang_ext.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)
LOAD_FORMATS: Final = ("", "auto", "safetensors", "dummy")
# The geometry a checkpoint must share with the running model to be loaded into it.
_GEOMETRY: Final = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias", "qk_norm", "moe")


class LoadRefused(Exception):
    """The checkpoint cannot replace the running weights; the message says why (for the client)."""


@dataclass
class WeightUpdates:
    """The worker's pending reload and the requests held while it drains."""

    pending: list[UpdateWeightsReq] = field(default_factory=list)
    held: list[GenerateReq] = field(default_factory=list)

    @property
    def draining(self) -> bool:
        return bool(self.pending)

    def drop(self, rid: str) -> bool:
        """An aborted request that was held: gone (its client was answered by whoever aborted it)."""
        n = len(self.held)
        self.held = [m for m in self.held if m.rid != rid]
        return len(self.held) != n


def reload(runner: ModelRunner, cfg: ModelConfig, msg: UpdateWeightsReq, seed: int) -> ReplyOut:
    """Load `msg`'s checkpoint into the runner's model; the old weights stay on any failure."""
    t0 = time.perf_counter()
    try:
        fmt = msg.load_format
        if fmt not in LOAD_FORMATS:
            raise LoadRefused(f"load_format {fmt!r} is not supported (one of: auto, safetensors, dummy)")
        model_dir = _checked_dir(msg.model_path, cfg)
        _load(runner.model, model_dir, fmt == "dummy", seed)
    except LoadRefused as e:
        logger.warning("weights not updated from %s: %s", msg.model_path, e)
        return ReplyOut(rid=msg.rid, ok=False, data={"message": f"Failed to update weights: {e}"})
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    dt = time.perf_counter() - t0
    logger.info("weights updated from %s in %.2f s", msg.model_path, dt)
    return ReplyOut(rid=msg.rid, ok=True,
                    data={"message": f"Succeeded to update model weights from {msg.model_path} in {dt:.2f} s."})


def _checked_dir(model_path: str, cfg: ModelConfig) -> Path:
    if not model_path:
        raise LoadRefused("model_path is empty")
    try:
        model_dir = resolve_model_path(model_path)
        new = ModelConfig.from_path(model_dir)
    except (FileNotFoundError, ValueError) as e:
        raise LoadRefused(str(e)) from None
    except KeyError as e:
        raise LoadRefused(f"the config.json of {model_path!r} has no {e} field") from None
    diff = [f"{k} {getattr(new, k)!r} (serving {getattr(cfg, k)!r})" for k in _GEOMETRY
            if getattr(new, k) != getattr(cfg, k)]
    if diff:
        raise LoadRefused(f"the checkpoint at {model_path!r} does not fit the running model: {', '.join(diff)}")
    return model_dir


@torch.no_grad()
def _load(model: torch.nn.Module, model_dir: Path, dummy: bool, seed: int) -> None:
    backup = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    try:
        if dummy:
            init_dummy_weights(model, seed)
        else:
            model.load_weights(iter_safetensors(model_dir))  # type: ignore[operator]
    except Exception as e:  # whatever the files held, the model goes back to what it served
        params = dict(model.named_parameters())
        for name, saved in backup.items():
            params[name].copy_(saved)
        raise LoadRefused(f"{type(e).__name__}: {e}") from None
