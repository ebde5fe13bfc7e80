"""Turn `--model-path` into a local model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Final

PRESET_PREFIX: Final = "preset:"


def resolve_model_path(path: str | None) -> Path:
    """None -> the embedded default model; "preset:NAME" -> a config-only directory for
    `--load-format dummy`; anything else must be an existing local HF model directory."""
    if path is None or path == "":
        from sglang_ext.models.default_model import ensure_default_model

        return ensure_default_model()
    if path.startswith(PRESET_PREFIX):
        from sglang_ext.configs import preset_dir

        return preset_dir(path.removeprefix(PRESET_PREFIX))
    p = Path(path).expanduser()
    if not p.is_dir():
        from sglang_ext.configs import preset_names

        # Hub ids such as "meta-llama/Llama-3-8B" land here: nothing is downloaded.
        raise FileNotFoundError(
            f"model path {path!r} is not a local directory. Pass a downloaded HF model directory, "
            f"'preset:NAME' (one of {', '.join(preset_names())}; use with --load-format dummy), "
            "or omit --model-path for the embedded default model."
        )
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(p)!r} has no config.json")
    return p
