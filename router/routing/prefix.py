"""An approximate index of the prompts the router sent to each replica: which replica has most likely
cached the longest prefix of a new prompt.

A key is cut into blocks of `block_chars` characters; block i is named by a hash chained over blocks
0..i, so one name stands for a whole prefix, as a path from the root of a radix tree does. Each replica
(a tenant) holds the names of the prefixes it was sent, in least-recently-used order. Matching walks a
prompt's names while a tenant holds them: O(prompt length / block) dictionary lookups per tenant.

Approximate: a match is whole blocks (a shorter tail is never matched), the index is what the router sent,
not what the replica still caches, and two different prefixes may (with 2^-64 odds) share a name.

Memory is bounded: a tenant holds at most `max_chars // block_chars` names; past that its least recently
used go first. Inserting a prompt touches its names from the last block to the first, so a prefix is
always at least as recent as its extensions and eviction trims leaves before the prefixes they hang
from, as a radix cache's LRU does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

BLOCK_CHARS = 32


class PrefixIndex:
    def __init__(self, max_chars: int, block_chars: int = BLOCK_CHARS) -> None:
        if block_chars < 1 or max_chars < block_chars:
            raise ValueError(f"need 1 <= block_chars <= max_chars, got {block_chars} and {max_chars}")
        self.block = block_chars
        self.max_blocks = max_chars // block_chars
        self._tenants: dict[str, OrderedDict[int, None]] = {}

    def names(self, key: str) -> list[int]:
        """The chained names of `key`'s whole blocks, shortest prefix first."""
        out: list[int] = []
        h = 0
        for i in range(0, len(key) - self.block + 1, self.block):
            h = hash((h, key[i:i + self.block]))
            out.append(h)
        return out

    def match(self, names: list[int], tenants: Iterable[str]) -> dict[str, int]:
        """Characters of the longest indexed prefix per tenant (0 for tenants that hold none)."""
        out: dict[str, int] = {}
        for t in tenants:
            held = self._tenants.get(t)
            n = 0
            if held is not None:
                for name in names:
                    if name not in held:
                        break
                    n += 1
            out[t] = n * self.block
        return out

    def insert(self, names: list[int], tenant: str) -> None:
        held = self._tenants.setdefault(tenant, OrderedDict())
        for name in reversed(names):  # the first block ends most recent: leaves are evicted first
            held[name] = None
            held.move_to_end(name)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def remove(self, tenant: str) -> None:
        """Forget a tenant (its cache is gone: a restarted replica)."""
        self._tenants.pop(tenant, None)

    def chars(self, tenant: str) -> int:
        """Characters indexed for `tenant` (whole blocks)."""
        held = self._tenants.get(tenant)
        return len(held) * self.block if held is not None else 0
