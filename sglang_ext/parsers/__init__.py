"""Output parsers of the OpenAI layer: tool calls (one file per model family over base.py) and
`<think>` reasoning. The names (and aliases) are SGLang's, so `--tool-call-parser` and
`--reasoning-parser` values carry over."""

from __future__ import annotations

from typing import Final

from sglang_ext.parsers.base import ToolParser
from sglang_ext.parsers.llama3 import Llama3Parser
from sglang_ext.parsers.mistral import MistralParser
from sglang_ext.parsers.qwen25 import Qwen25Parser

TOOL_PARSERS: Final[dict[str, type[ToolParser]]] = {
    "qwen25": Qwen25Parser, "qwen": Qwen25Parser, "qwen3": Qwen25Parser, "hermes": Qwen25Parser,
    "llama3": Llama3Parser, "mistral": MistralParser,
}
# name -> whether the output starts inside the reasoning block (the template opened it)
REASONING_PARSERS: Final[dict[str, bool]] = {"qwen3": False, "qwen3-thinking": True, "deepseek-r1": True}


def tool_parser_name(name: str) -> str:
    """The canonical name of a tool-call parser (an alias resolved); ValueError naming the choices."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}; got {name!r}")
    return cls.name


def check_reasoning_parser(name: str) -> str:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; got {name!r}")
    return name
