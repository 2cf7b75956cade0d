"""Fixes to Triton's CPU interpreter that the kernels' tests rely on (imported only when interpreting).

The interpreter stores bfloat16 as raw uint16 (numpy has no bfloat16), and its ``tl.dot`` multiplies
those raw integers, so every bf16 product is garbage. Here ``create_dot`` widens bf16 operands to
fp32 first (a shift: bf16 is fp32's upper half), which is what the tensor cores compute: exact
products, an fp32 sum. Compiled kernels never see this module, so their code is unchanged.
"""
from __future__ import annotations

import numpy as np
import triton.language as tl
from triton.runtime import interpreter as _interp


def _widen_bf16(x):
    if x.dtype != tl.bfloat16:     # a TensorHandle holds the scalar type
        return x
    wide = (x.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return _interp.TensorHandle(wide, tl.float32)


def install() -> None:
    """Patch the interpreter's ``create_dot`` once (idempotent)."""
    builder = _interp.InterpreterBuilder
    if getattr(builder.create_dot, "_triflash_bf16", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, *args, **kwargs):
        return original(self, _widen_bf16(a), _widen_bf16(b), *args, **kwargs)

    create_dot._triflash_bf16 = True
    builder.create_dot = create_dot
