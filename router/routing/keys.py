"""The routing key of a request: its whole prompt as one string, so that requests sharing a prompt
prefix share a key prefix (what the prefix index and cache_aware match on).

A kind tag keeps texts, token ids and chat messages apart (their prefixes never mean the same cache).
Token ids become one character each (`chr`), so an id prompt is matched token by token with the same
string index as a text is matched character by character; chat messages are their JSON, whose prefix
grows with the conversation (turn n+1's list starts as turn n's did, up to its closing bracket).
"""

from __future__ import annotations

import msgspec

from sglang_ext.messages import GenerateReq

_CODE_POINTS = 0x110000


def route_key(req: GenerateReq) -> str | None:
    if req.text is not None:
        return "t:" + req.text
    if req.input_ids is not None:
        try:
            return "i:" + "".join(map(chr, req.input_ids))
        except (ValueError, OverflowError):  # an id no vocabulary has: the worker refuses it; the key need not
            return "i:" + "".join(chr(t % _CODE_POINTS) for t in req.input_ids)
    if req.messages:
        return "m:" + msgspec.json.encode(req.messages).decode()
    return None
