"""Block sizes of the MoE grouped GEMMs: a tuned JSON file when one matches, hand-picked defaults otherwise.

A file `configs/E=<E>,N=<I>,H=<H>,dtype=<dtype>,device=<device>.json` (written by `bench/tune_moe.py`)
maps batch sizes (tokens per forward, as strings) to one config each; the entry whose batch size is
nearest to T is used. A config is

    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3,
     "down": {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}}

where the top level drives the gate/up GEMM (and the block alignment, so BLOCK_M is shared) and
`down` overrides the rest for the down GEMM (missing keys inherit the top level).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Final, cast

import torch

logger = logging.getLogger(__name__)
CONFIG_DIR: Final = Path(__file__).parent / "configs"
# GPUs built on one chip (Hopper GH100, 132 SMs, the same caches): block sizes tuned on one suit the others
# far better than the hand-picked defaults, so a GPU without a table of its own uses a sibling's (logged).
# Only the memory differs (HBM3 / HBM3e), which moves a tile's speed, not which tile is fastest, as
# closely as tuning can tell at decode sizes (where both are weight-streaming bound).
SAME_CHIP: Final = (frozenset({"NVIDIA_H100_80GB_HBM3", "NVIDIA_H200", "NVIDIA_GH200_480GB"}),)
KEYS: Final = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")

Config = dict[str, int]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_name(device: torch.device) -> str:
    return _cuda_name(device.index or 0) if device.type == "cuda" else device.type


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_")


def config_file_name(num_experts: int, inter: int, hidden: int, dtype: torch.dtype, device: str) -> str:
    return f"E={num_experts},N={inter},H={hidden},dtype={dtype_name(dtype)},device={device}.json"


@functools.cache
def _load(path: Path) -> dict[int, dict[str, object]] | None:
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return {int(t): cfg for t, cfg in raw.items() if not t.startswith("_")}


def default_config(tokens: int, top_k: int, num_experts: int) -> dict[str, object]:
    """Hand-picked for H100/H200-class GPUs (not measured: run `bench/tune_moe.py` there).

    Few tokens per expert (decode) is a weight-streaming problem: short M tiles, deep K tiles, many
    programs over N. Many (prefill) is compute-bound: large square-ish tiles, grouped M ordering so
    neighbouring programs share weight tiles in L2. The gate/up GEMM keeps two accumulators (gate
    and up) per program, so it gets more warps / fewer stages than the down GEMM at the same tile.
    """
    per_expert = tokens * top_k / max(num_experts, 1)
    if per_expert <= 16 and tokens <= 64:
        # GROUP_M 16 even here: an expert that drew more than BLOCK_M pairs spans two blocks, and with
        # GROUP_M 1 the second block streams the expert's weights from HBM again (every N tile of the
        # first block runs before it; Mixtral's expert is 235 MB against a 50 MB L2). The H200 tuning
        # picked GROUP_M 16 wherever an expert had several blocks (Mixtral T=64, Qwen3 T>=64).
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 16, "num_warps": 4, "num_stages": 3,
                "down": {"num_stages": 4}}
    if per_expert <= 64:
        bm = 16 if per_expert <= 16 else (32 if per_expert <= 32 else 64)
        return {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4,
                "down": {"BLOCK_N": 128}}
    if per_expert <= 512:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 16, "num_warps": 8, "num_stages": 3,
                "down": {"num_warps": 4, "num_stages": 4}}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 16, "num_warps": 8, "num_stages": 3,
            "down": {"num_stages": 4}}


def get_config(
    tokens: int,
    top_k: int,
    num_experts: int,
    inter: int,
    hidden: int,
    dtype: torch.dtype,
    device: str,
    config_dir: Path = CONFIG_DIR,
) -> dict[str, object]:
    """The config for T tokens: the nearest batch size of a matching file, else the defaults.

    A table is trusted up to twice its largest tuned T: a tuning run cut short (Mixtral's first H200
    table stops at T=64) must not hand a decode tile to a 4096-token prefill.
    """
    table = _table(num_experts, inter, hidden, dtype, device, config_dir)
    if table and tokens <= 2 * max(table):
        return table[min(table, key=lambda t: (abs(t - tokens), t))]
    return default_config(tokens, top_k, num_experts)


def distinct_configs(max_tokens: int, top_k: int, num_experts: int, inter: int, hidden: int, dtype: torch.dtype,
                     device: str, config_dir: Path = CONFIG_DIR) -> dict[int, dict[str, object]]:
    """Every config `get_config` can pick for 1..max_tokens tokens, keyed by the fewest tokens that pick it.

    Each config is a compiled variant of the two GEMM kernels (its block sizes are constexprs). One
    forward at each key compiles them all before serving; otherwise the first batch that reaches a
    config Triton has not built compiles it mid-run. That batch is easy to miss: a full prefill chunk
    plus the decoding rows riding along (8,192 + rows) lies past a table trusted to 8,192 tokens, so
    it takes the defaults, which no warm-up prompt of at most 8,192 tokens reaches.
    """
    seen: dict[str, int] = {}
    out: dict[int, dict[str, object]] = {}
    for t in range(1, max_tokens + 1):
        cfg = get_config(t, top_k, num_experts, inter, hidden, dtype, device, config_dir)
        key = json.dumps(cfg, sort_keys=True)
        if key not in seen:
            seen[key] = t
            out[t] = cfg
    return out


@functools.cache
def _table(num_experts: int, inter: int, hidden: int, dtype: torch.dtype, device: str,
           config_dir: Path) -> dict[int, dict[str, object]] | None:
    """This GPU's table, else one tuned on a GPU of the same chip (SAME_CHIP), else None."""
    own = _load(config_dir / config_file_name(num_experts, inter, hidden, dtype, device))
    if own is not None:
        return own
    for group in SAME_CHIP:
        for other in sorted(group - {device}) if device in group else ():
            path = config_dir / config_file_name(num_experts, inter, hidden, dtype, other)
            table = _load(path)
            if table is not None:
                logger.info("MoE block sizes: no table for %s, using %s's (same chip): %s", device, other, path.name)
                return table
    return None


def split(cfg: dict[str, object]) -> tuple[Config, Config]:
    """(gate/up config, down config), each with every key of KEYS; `down` inherits what it omits."""
    up = {k: int(cast(int, cfg[k])) for k in KEYS}
    over = cast(dict[str, int], cfg.get("down") or {})
    down = {k: int(over.get(k, up[k])) for k in KEYS}
    down["BLOCK_M"] = up["BLOCK_M"]
    return up, down
