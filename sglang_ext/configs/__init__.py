"""Geometry presets: the `config.json` of well-known checkpoints, for `--load-format dummy` runs.

A preset is materialised as a directory holding only its config.json, so every code path that
takes a model directory works unchanged (`--model-path preset:llama-3-8b` resolves to it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Final

from sglang_ext import env

_PRESET_DIR: Final = Path(__file__).resolve().parent


def cache_root() -> Path:
    """Where generated model directories live: `$SGLANG_EXT_CACHE`, else `~/.cache/sglang_ext`."""
    return env.CACHE.get() or Path.home() / ".cache" / "sglang_ext"


def preset_names() -> list[str]:
    return sorted(p.stem for p in _PRESET_DIR.glob("*.json"))


def preset_config_file(name: str) -> Path:
    f = _PRESET_DIR / f"{name}.json"
    if not f.is_file():
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    return f


def preset_dir(name: str, cache_dir: Path | None = None) -> Path:
    """A directory containing just the preset's config.json (rewritten if the preset changed)."""
    text = preset_config_file(name).read_bytes()
    out = (cache_dir or cache_root()) / "presets" / name
    target = out / "config.json"
    if target.is_file() and target.read_bytes() == text:
        return out
    out.mkdir(parents=True, exist_ok=True)
    # Write-then-rename so a concurrent reader sees either the old file or the new one, never half.
    fd, tmp = tempfile.mkstemp(prefix=".config.", suffix=".json", dir=out)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


__all__ = ["cache_root", "preset_config_file", "preset_dir", "preset_names"]
