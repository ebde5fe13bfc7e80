"""`cudaMemcpyBatchAsync` through cuda-python: many pointer-to-pointer copies in one API call.

Imported on first use, so CPU machines never load cuda-python. Bindings tried in order:
1. `cuda.bindings.driver.cuMemcpyBatchAsync` (`cuda.cuda` in cuda-python < 12.6): the driver API acts on
   the thread's current context, which torch has made current; the same binding carries this repo's
   GPU signalling (transport/cuda_signal.py), seen working on the H200. Pointers must be `CUdeviceptr`
   objects (~0.1 us each to build).
2. `cuda.bindings.runtime.cudaMemcpyBatchAsync` (`cuda.cudart` before 12.6): takes plain ints.
The Python signature is the same in the 12.8+ and 13.x bindings; the result differs: 12.x returns
`(err, failIdx)` (12.8's C API had a `failIdx` out-parameter), 13.x `(err,)` (13.0 dropped it, and the
13.x driver binding calls the driver's `_v2` entry point). Only `err` is read, so both work. The batch
API needs a CUDA >= 12.8 driver and bindings; when missing, `load()` raises `BatchCopyUnavailable`
naming why, and the rotation engine falls back to one copy per run.
"""

from __future__ import annotations

import importlib
from typing import Any


class BatchCopyUnavailable(RuntimeError):
    """cuda-python or its batch-copy binding is missing, or the call failed (the message says which)."""


class BatchCopy:
    """One bound batch-copy function; `__call__` enqueues the copies on a raw stream handle."""

    def __init__(self, api: str, fn: Any, attr: Any, wrap_ptr: Any, wrap_stream: Any, err_name: Any) -> None:
        self.api = api  # which binding, for the benchmark's record
        self._fn, self._attr, self._ptr, self._stream, self._err_name = fn, attr, wrap_ptr, wrap_stream, err_name

    def __call__(self, dsts: list[int], srcs: list[int], sizes: list[int], stream: int) -> None:
        n = len(dsts)
        if n == 0:
            return
        try:
            d: list[Any] = dsts
            s: list[Any] = srcs
            if self._ptr is not None:
                d, s = [self._ptr(p) for p in dsts], [self._ptr(p) for p in srcs]
            # One attribute entry covers every copy (attrsIdxs = [0], numAttrs = 1).
            res = self._fn(d, s, sizes, n, [self._attr], [0], 1, self._stream(stream))
        except Exception as e:  # e.g. cuda-python cannot find the driver library
            raise BatchCopyUnavailable(f"{self.api} batch copy raised {type(e).__name__}: {e}") from None
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            raise BatchCopyUnavailable(f"{self.api} batch copy failed: {self._name(err)} ({int(err)})")

    def _name(self, err: Any) -> str:
        try:
            _, name = self._err_name(err)
            return name.decode() if isinstance(name, bytes) else str(err)
        except Exception:  # naming the error is best effort; the failure itself is what matters
            return str(err)


_loaded: dict[str, BatchCopy] = {}


def load(api: str = "auto") -> BatchCopy:
    """The batch-copy binding: `api` = "auto" (driver, then runtime), "driver" or "runtime"."""
    if api not in ("auto", "driver", "runtime"):
        raise ValueError(f"batch copy api must be auto, driver or runtime, got {api!r}")
    if api not in _loaded:
        reasons: list[str] = []
        order = ("driver", "runtime") if api == "auto" else (api,)
        for which in order:
            try:
                _loaded[api] = _driver() if which == "driver" else _runtime()
                break
            except BatchCopyUnavailable as e:
                reasons.append(str(e))
        else:
            raise BatchCopyUnavailable("; ".join(reasons))
    return _loaded[api]


def _import_first(*names: str) -> Any:
    errors = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise BatchCopyUnavailable("cuda-python not importable (" + "; ".join(errors) + ")")


def _driver() -> BatchCopy:
    dr = _import_first("cuda.bindings.driver", "cuda.cuda")
    if not hasattr(dr, "cuMemcpyBatchAsync"):
        raise BatchCopyUnavailable(f"{dr.__name__} has no cuMemcpyBatchAsync (bindings older than CUDA 12.8)")
    try:
        (err,) = dr.cuInit(0)  # idempotent; torch has initialised the driver already
    except Exception as e:
        raise BatchCopyUnavailable(f"cuInit raised {type(e).__name__}: {e}") from None
    if int(err) != 0:
        raise BatchCopyUnavailable(f"cuInit failed ({int(err)})")
    attr = dr.CUmemcpyAttributes()
    # Stream order: the source is read only after the work queued before the copy on its stream (the
    # wait on the compute stream), which is what makes a swap-out see the last step's writes.
    attr.srcAccessOrder = dr.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    # A hint to keep the copies on the copy engines, overlapping the model's kernels.
    attr.flags = dr.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    return BatchCopy(dr.__name__, dr.cuMemcpyBatchAsync, attr, dr.CUdeviceptr, dr.CUstream, dr.cuGetErrorName)


def _runtime() -> BatchCopy:
    rt = _import_first("cuda.bindings.runtime", "cuda.cudart")
    if not hasattr(rt, "cudaMemcpyBatchAsync"):
        raise BatchCopyUnavailable(f"{rt.__name__} has no cudaMemcpyBatchAsync (bindings older than CUDA 12.8)")
    attr = rt.cudaMemcpyAttributes()
    attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream  # as in _driver
    attr.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
    return BatchCopy(rt.__name__, rt.cudaMemcpyBatchAsync, attr, None, rt.cudaStream_t, rt.cudaGetErrorName)
