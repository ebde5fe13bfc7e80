"""Build a model from a directory: safetensors (single or sharded) or dummy random weights."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from sglang_ext.models import model_class
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir} (use --load-format dummy for random weights)")
    return files


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, st.get_tensor(name)


def init_dummy_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights (SGLang's `--load-format dummy`); norms stay at one.

    Drawn on the parameters' device: drawing 8B values on the CPU and copying them over took most
    of a minute of a GPU worker's start. A seed gives the same weights on every run on the same
    kind of device (CPU and CUDA generators draw different sequences)."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)

    def draw(n: int | tuple[int, ...]) -> torch.Tensor:
        return torch.randn(n, generator=gen, dtype=torch.float32, device=dev).mul_(std)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.copy_(draw(tuple(p.shape)))
            else:
                # In chunks: the float32 draw of a whole embedding would be a large extra buffer.
                flat = p.view(-1)
                step = 1 << 26
                for i in range(0, flat.numel(), step):
                    n = min(step, flat.numel() - i)
                    flat[i : i + n].copy_(draw(n))


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    seed: int = 0,
) -> DecoderForCausalLM:
    cls = model_class(cfg)
    # Build directly in the target dtype on the target device (no float32 copy of a large model);
    # RoPE tables are made in float32 explicitly.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg, max_positions=max_positions)
    finally:
        torch.set_default_dtype(old)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        model.load_weights(iter_safetensors(Path(model_dir)))
    return model.eval()
