"""Adrenaline's per-request offload conditions (the Adrenaline paper's algorithm 1), applied by the sender.

`ob` is the planner's upper bound OB(n, B_max): offloaded KV tokens over local KV tokens. A request
that has just finished its prefill goes to the executor when

    C1  attn_used + req_max_tokens < decode_used * ob            its KV at its longest still fits, or
    C2  attn_used + req_used_tokens < decode_used * ob           its KV now fits
        and |OR| + 1 < |LR| * ob                                 and the offloaded count stays in bound

where OR is the set of offloaded requests (attn_used: their KV tokens now), LR the locally decoding
ones (decode_used: theirs), req_max_tokens the request's prompt plus its max_new_tokens and
req_used_tokens its KV now. The comparisons are strict, as in the paper.
"""

from __future__ import annotations

from typing import NamedTuple


class Loads(NamedTuple):
    attn_used: int  # KV tokens of the offloaded requests
    num_remote: int  # |OR|
    decode_used: int  # KV tokens of the locally decoding requests
    num_local: int  # |LR|


def c1(loads: Loads, req_max_tokens: int, ob: float) -> bool:
    return loads.attn_used + req_max_tokens < loads.decode_used * ob


def c2(loads: Loads, req_used_tokens: int, ob: float) -> bool:
    return (loads.attn_used + req_used_tokens < loads.decode_used * ob
            and loads.num_remote + 1 < loads.num_local * ob)


def should_offload(loads: Loads, req_max_tokens: int, req_used_tokens: int, ob: float) -> bool:
    return c1(loads, req_max_tokens, ob) or c2(loads, req_used_tokens, ob)
