"""Routing settings: the policy names, the cache_aware thresholds, and how a model's own settings
override the router-wide ones.

Router-wide defaults are `RouterConfig` fields (so also launcher flags: `--routing`, `--cache-threshold`,
...); a model may override them in the cluster file with `routing:` and `cache_aware: {...}`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Final

import msgspec
from msgspec import Meta

POLICIES: Final = ("prefix_affinity", "cache_aware", "shortest_queue", "round_robin")
DEFAULT_POLICY: Final = "prefix_affinity"  # what the router did before policies were selectable

# A policy name, checked where it is decoded (cluster file and launcher flags alike): a pattern keeps the
# type a plain `str`, which the launcher turns into a flag without knowing about policies.
PolicyName = Annotated[str, Meta(pattern=f"^({'|'.join(POLICIES)})$",
                                 description=f"how requests are spread over a model's replicas: {', '.join(POLICIES)}")]
CacheThreshold = Annotated[float, Meta(ge=0, le=1, description=(
    "cache_aware: the share of a prompt a replica must have been sent before for the prompt to follow it"))]
BalanceAbs = Annotated[int, Meta(ge=0, description=(
    "cache_aware: replicas are imbalanced when the busiest has more than this many requests over the idlest"))]
BalanceRel = Annotated[float, Meta(ge=1, description=(
    "cache_aware: ... and more than this many times the idlest's requests (both must hold)"))]
MaxPrefixChars = Annotated[int, Meta(ge=1024, description=(
    "cache_aware: characters (token ids: one each) of prompts remembered per replica; least recent go first"))]


class CacheAwareSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A model's `cache_aware:` settings; each one omitted is the router's."""

    cache_threshold: CacheThreshold | None = None
    balance_abs_threshold: BalanceAbs | None = None
    balance_rel_threshold: BalanceRel | None = None
    max_prefix_chars: MaxPrefixChars | None = None


@dataclass(frozen=True)
class RoutingSettings:
    """One model's policy and its settings, resolved."""

    policy: str = DEFAULT_POLICY
    # SGLang's router uses a 0.3-0.5 threshold; 0.5: half the prompt must be known to a replica.
    cache_threshold: float = 0.5
    # In requests (the router's own count of in flight, not a report that lags). SGLang's router uses 32-64
    # and 1.5: a replica many requests behind another is worth a cache miss.
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    # ~13 MB of index per replica; 4M characters is ~1M tokens of text, a large GPU's KV cache.
    max_prefix_chars: int = 1 << 22

    def override(self, policy: str | None, spec: CacheAwareSpec | None) -> RoutingSettings:
        out = self if policy is None else replace(self, policy=policy)
        if spec is not None:
            given = {f: v for f in spec.__struct_fields__ if (v := getattr(spec, f)) is not None}
            out = replace(out, **given)
        return out


def model_routing(where: str, base: RoutingSettings, policy: str | None,
                  spec: CacheAwareSpec | None) -> RoutingSettings:
    """A model's settings from the router's and its own; ValueError names a setting that cannot apply."""
    out = base.override(policy, spec)
    if spec is not None and out.policy != "cache_aware":
        raise ValueError(f"{where}.cache_aware: settings of routing cache_aware, but the model routes "
                         f"{out.policy} (set `routing: cache_aware` on it, or drop `cache_aware:`)")
    return out
