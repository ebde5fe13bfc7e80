"""sglang_ext: an SGLang-family serving runtime with movable attention and KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from sglang_ext.entry.engine import Engine


def __getattr__(name: str) -> Any:
    # Lazy: `import sglang_ext` stays cheap (no torch) for the router and CLI parsing.
    if name == "Engine":
        from sglang_ext.entry.engine import Engine

        return Engine
    if name == "ServerArgs":
        from sglang_ext.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(name)


__all__ = ["Engine", "ServerArgs", "__version__"]
