"""Adrenaline's offload bound OB(n, B_max) (the Adrenaline paper, section 3.4.1), computed by the router.

OB bounds offloaded decode-attention KV tokens over the sender's local ones. With n executors per
decode (sender) worker, each giving it M_e KV tokens and a share beta of its GPU's HBM bandwidth
relative to the sender's, and a decode batch B whose dense kernels (QKV, output projection, FFN)
turn compute-bound at B_max:

    memory      n * M_e / M_d          the executors hold no more than they were given
    bandwidth   n * beta               remote attention keeps pace with local attention
    dense       B_max / B - 1          offloading grows the batch B * (1 + OB); past B_max the dense
                                       kernels are compute-bound and a larger batch no longer pays

    OB(n, B_max) = max(0, min(memory, bandwidth, dense))

M_d is the sender's own KV capacity and M_e the tokens the pairing holds plus those it could still
get (the host's report). The sender applies C1/C2 under OB per request; as a share of its decoding
requests OB allows at most OB / (1 + OB).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from sglang_ext.offload.planning.base import Decision, PairView, Policy
from sglang_ext.offload.planning.spec import AdrenalineSpec


class Bound(NamedTuple):
    ob: float
    memory: float
    bandwidth: float
    dense: float


def offload_bound(n: int, exec_tokens: int, decode_tokens: int, bandwidth_share: float, b_max: int,
                  batch: int) -> Bound:
    memory = n * exec_tokens / decode_tokens if decode_tokens > 0 else 0.0
    bandwidth = n * bandwidth_share
    dense = b_max / batch - 1.0 if batch > 0 else math.inf
    return Bound(max(0.0, min(memory, bandwidth, dense)), memory, bandwidth, dense)


class Adrenaline(Policy):
    name = "adrenaline"

    def decide(self, view: PairView) -> Decision:
        spec = self.rule.adrenaline or AdrenalineSpec()
        b = offload_bound(1, view.exec_used + view.exec_free, view.sender_kv_tokens, spec.bandwidth_share,
                          spec.b_max, view.sender_batch)
        share = min(self.rule.cap, b.ob / (1.0 + b.ob))
        why = f"OB {b.ob:.3g} = min(memory {b.memory:.3g}, bandwidth {b.bandwidth:.3g}, dense {b.dense:.3g})"
        return Decision(share, share, b.ob, why)
