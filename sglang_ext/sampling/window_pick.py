"""The top-k window draw's last step as one Triton kernel (GPU only; imported lazily).

After FlashInfer's softmax and radix top-k, each row's window is its k largest probabilities in
descending order. Finding the top-k / top-p threshold and drawing from the kept tokens is a
handful of tiny [B, k] operations in torch (~25 kernels, each a few microseconds of launch-bound
device time): here it is one program per row. Because the window is sorted and the threshold keeps
every value at or above it, the kept tokens are a prefix of the window, so the draw inverts that
prefix's cumulative mass at one uniform per row (Triton's Philox, keyed by a per-call seed the
host counts, so nothing is read back from the device).

Semantics are `sampler.sorted_threshold` followed by an inverse-CDF draw over the kept prefix;
tests/test_window_pick.py checks it against the sort-based reference, under Triton's interpreter
(TRITON_INTERPRET=1) on a CPU machine; tests/test_gpu_sampling.py checks the whole draw on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_WINDOW = 1024  # one program holds the whole window in registers
MIN_BLOCK = 256  # windows up to this share one compiled kernel per top-p flag (see `warm`)


@triton.jit(do_not_specialize=["seed"])
def _pick_kernel(vals, ids, top_k, top_p, out, seed, K, vals_stride, ids_stride,
                 HAS_P: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inside = offs < K
    v = tl.load(vals + row * vals_stride + offs, mask=inside, other=0.0)
    cum = tl.cumsum(v, 0)
    # top-k: the k-th largest value (every row here has 0 < k <= K)
    n = tl.minimum(tl.load(top_k + row), K).to(tl.int32)
    t = tl.sum(tl.where(offs == n - 1, v, 0.0), 0)
    if HAS_P:
        # top-p: the last token whose mass strictly above it is at most p
        before = cum - v
        last = tl.maximum(tl.sum(((before <= tl.load(top_p + row)) & inside).to(tl.int32), 0), 1) - 1
        t = tl.maximum(t, tl.sum(tl.where(offs == last, v, 0.0), 0))
    keep = inside & (v >= t)
    kept = tl.sum(keep.to(tl.int32), 0)
    total = tl.sum(tl.where(keep, v, 0.0), 0)
    u = tl.sum(tl.where(offs == 0, tl.rand(seed, row * BLOCK + offs), 0.0), 0)
    # the first kept token whose cumulative mass exceeds u * total
    at = tl.minimum(tl.sum((keep & (cum <= u * total)).to(tl.int32), 0), kept - 1)
    tl.store(out + row, tl.load(ids + row * ids_stride + at).to(tl.int64))


def pick(vals: torch.Tensor, ids: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, any_top_p: bool,
         seed: int) -> torch.Tensor:
    """Token ids [B] (int64) drawn from each row's window: `vals` [B, K] descending probabilities,
    `ids` [B, K] their token ids, `top_k` [B] (each in 1..K), `top_p` [B]. `seed` must change per call."""
    b, k = vals.shape
    assert vals.stride(1) == 1 and ids.stride(1) == 1, "rows of the window must be contiguous"
    assert k <= MAX_WINDOW, f"a window of {k} tokens; at most {MAX_WINDOW}"
    out = torch.empty(b, dtype=torch.int64, device=vals.device)
    if b:
        block = max(triton.next_power_of_2(k), MIN_BLOCK)
        _pick_kernel[(b,)](vals, ids, top_k, top_p, out, seed & 0x7FFFFFFF, k, vals.stride(0), ids.stride(0),
                           HAS_P=any_top_p, BLOCK=block, num_warps=4)
    return out


def warm(device: torch.device | str) -> None:
    """Compile both variants now (about a second each), not in a serving step."""
    vals = torch.ones(1, 1, device=device)
    ids = torch.zeros(1, 1, dtype=torch.int64, device=device)
    for any_top_p in (False, True):
        pick(vals, ids, ids.view(1), vals.view(1), any_top_p, seed=0)
