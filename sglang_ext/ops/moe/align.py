"""Sort the (token, slot) pairs by expert and pad each expert's run to a multiple of BLOCK_M, on the device.

The grouped GEMMs take BLOCK_M rows at a time and every block must belong to one expert. With
n = T*k pairs (pair p is token p // k, slot p % k) and E_local experts, the outputs are

    sorted_ids   [n + min(E, n) * (BLOCK_M - 1)] int32: pair ids grouped by local expert, in token
                 order within an expert, each expert's run padded with the sentinel n
    expert_ids   [len(sorted_ids) / BLOCK_M, rounded up] int32: the local expert of each block
    num_padded   [1] int32: the used length of sorted_ids (entries and blocks past it are unspecified)

    sorted_ids:  | e0 e0 e0 pad | e2 e2 e2 e2 | e2 pad pad pad | e3 pad pad pad | ... unused ...
    expert_ids:  |      0       |      2      |       2        |       3        | ... unused ...

Sizes depend only on the shapes (at most min(E, n) experts are hit, each wasting < BLOCK_M slots),
so there is no host sync and the step is CUDA-graph safe. Pairs whose expert is outside
[first_expert, first_expert + E_local) are left out. Two launches, one program per local expert:
the first counts its pairs, the second reads every count, places its run at the prefix sum of the
padded counts before it, and writes its pair ids (a cumulative sum over its matches gives ranks),
its padding and its block ids. Each scans all n ids: E*n compares, trivial next to the GEMMs.
"""

from __future__ import annotations

from typing import Final, NamedTuple

import torch
import triton
import triton.language as tl

SCAN: Final = 1024  # ids read per step of the scans

# Sizes that change with the batch are left unspecialized: Triton would otherwise compile another variant of
# the kernel for each divisibility of these ints (by 16, or == 1) the first time a batch brings one, in the
# middle of serving (a fresh machine's first server ran prefill forwards 2-5x slow for its first seconds:
# bench/results/2026-12-06-h200-s9/README.md); a hint lost on a loop bound costs nothing measurable.
SIZES = ("n",)


@triton.jit(do_not_specialize=SIZES)
def _count_kernel(ids_ptr, counts_ptr, n, first_expert, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    target = e + first_expert
    c = tl.zeros([BLOCK], dtype=tl.int32)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        v = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
        c += (v == target).to(tl.int32)
    tl.store(counts_ptr + e, tl.sum(c, axis=0))


@triton.jit(do_not_specialize=SIZES)
def _place_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, n, n_experts, first_expert,
                  BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    e = tl.program_id(0)
    ecols = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + ecols, mask=ecols < n_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(ecols < e, padded, 0), axis=0)
    length = tl.sum(tl.where(ecols == e, padded, 0), axis=0)
    count = tl.sum(tl.where(ecols == e, counts, 0), axis=0)
    if e == 0:
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    if count > 0:
        first_block = start // BLOCK_M
        n_blocks = length // BLOCK_M
        for b in range(0, n_blocks, BLOCK):
            blk = b + tl.arange(0, BLOCK)
            tl.store(expert_ids_ptr + first_block + blk, tl.zeros([BLOCK], dtype=tl.int32) + e, mask=blk < n_blocks)
        pad = count + tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + start + pad, tl.zeros([BLOCK_M], dtype=tl.int32) + n, mask=pad < length)
        target = e + first_expert
        base = start
        for s in range(0, n, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            hit = (tl.load(ids_ptr + offs, mask=offs < n, other=-1) == target).to(tl.int32)
            rank = tl.cumsum(hit, axis=0) - 1
            tl.store(sorted_ptr + base + rank, offs, mask=hit > 0)
            base += tl.sum(hit, axis=0)


class Aligned(NamedTuple):
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor


def max_padded(n_pairs: int, num_local: int, block_m: int) -> int:
    return n_pairs + min(num_local, n_pairs) * (block_m - 1)


def align_block_size(topk_ids: torch.Tensor, block_m: int, num_local: int, first_expert: int = 0) -> Aligned:
    """topk_ids [T, k] (global expert ids, any integer dtype) -> `Aligned` (see the module docstring)."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    n = ids.numel()
    size = max_padded(n, num_local, block_m)
    dev = ids.device
    sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(triton.cdiv(size, block_m), dtype=torch.int32, device=dev)
    num_padded = torch.zeros(1, dtype=torch.int32, device=dev)
    if n:
        counts = torch.empty(num_local, dtype=torch.int32, device=dev)
        _count_kernel[(num_local,)](ids, counts, n, first_expert, BLOCK=SCAN, num_warps=4)
        _place_kernel[(num_local,)](ids, counts, sorted_ids, expert_ids, num_padded, n, num_local, first_expert,
                                    BLOCK_M=block_m, BLOCK=SCAN, BLOCK_E=triton.next_power_of_2(num_local),
                                    num_warps=4)
    return Aligned(sorted_ids, expert_ids, num_padded)
