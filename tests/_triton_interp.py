"""Two fixes to Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) that the MoE kernel tests need.

Only the interpreter is patched, never compiled kernels:
- a scalar kernel argument is a one-element numpy array there, and `range(0, n, BLOCK)` over it calls
  `int()` on that array, which numpy 2.4 refuses for arrays of one dimension; read its one element.
- `tl.dot` of bfloat16 tiles multiplies their raw uint16 storage (bfloat16 has no numpy dtype);
  widen both operands to float32 first, which is what the tensor cores' products are anyway.
- a float32 -> bfloat16 cast truncates there; the GPU (and torch) round to nearest even.
"""

from __future__ import annotations

from typing import Any

_done = False


def patch() -> None:
    global _done
    if _done:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def _patch_tensor(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_tensor

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def _create_dot(self: Any, a: Any, b: Any, d: Any, *args: Any) -> Any:
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return create_dot(self, a, b, d, *args)

    builder.create_dot = _create_dot

    cast_impl = builder.cast_impl

    def _cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return interpreter.TensorHandle(bits.astype(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    builder.cast_impl = _cast_impl
    _done = True


def device(fixes: bool = True) -> str:
    """'cuda' where a GPU is. Otherwise Triton's interpreter is switched on and 'cpu' returned:
    TRITON_INTERPRET is read when a kernel is decorated and at each launch, so call this before
    importing the kernels; `fixes` applies `patch()` too."""
    import os

    import torch

    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    if fixes:
        patch()
    return "cpu"
