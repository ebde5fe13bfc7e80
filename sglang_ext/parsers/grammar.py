"""tool_choice as an xgrammar structural tag (the `structural_tag` constraint), written in the
parser's own format so the model writes calls the way it was trained to and the parser reads them:

- `required`: only calls (at least one), each one's arguments valid against its function's schema;
- a named function: exactly one call of it;
- `auto`: free text until the parser's trigger (e.g. `<tool_call>`), then a call that must be valid.

`parallel_tool_calls: false` ends the constraint after the first call. With a reasoning parser, a
`<think>` block (or, forced, the rest of one) may come first in `required` / named.
"""

from __future__ import annotations

import json
from typing import Any

from sglang_ext.parsers.base import ToolParser
from sglang_ext.parsers.reasoning import END, START

Format = dict[str, Any]
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _tag(parser: type[ToolParser], name: str, schema: Any) -> Format:
    return {"type": "tag", "begin": parser.call_begin_fmt.format(name=json.dumps(name)),
            "content": {"type": "json_schema", "json_schema": schema}, "end": parser.call_end}


def tool_call_tag(parser: type[ToolParser], functions: dict[str, Any], mode: str, parallel: bool,
                  reasoning: bool | None = None) -> str:
    """The structural tag (JSON text) for `functions` (name -> parameters schema); `mode` is auto,
    required, or the name of the function to call; `reasoning`: None without a reasoning parser, else
    whether the output starts inside the block."""
    named = mode not in ("auto", "required")
    chosen = {mode: functions[mode]} if named else functions
    tags = [_tag(parser, n, s if s is not None else EMPTY_PARAMETERS) for n, s in chosen.items()]
    calls: Format = {"type": "tags_with_separator", "tags": tags, "separator": parser.call_separator,
                     "at_least_one": True, "stop_after_first": named or not parallel}
    region: Format = calls
    if parser.call_prefix:
        region = {"type": "tag", "begin": parser.call_prefix, "content": calls, "end": parser.call_suffix}
    if mode == "auto":
        tagged = [region] if parser.call_prefix else tags
        fmt: Format = {"type": "triggered_tags", "triggers": [parser.trigger], "tags": tagged,
                       "stop_after_first": bool(parser.call_prefix) or not parallel}
    elif reasoning is None:
        fmt = region
    else:
        think: Format = {"type": "tag", "begin": "" if reasoning else START, "content": {"type": "any_text"},
                         "end": END + "\n\n"}
        fmt = {"type": "sequence", "elements": [think if reasoning else {"type": "optional", "content": think},
                                                region]}
    return json.dumps({"type": "structural_tag", "format": fmt})
