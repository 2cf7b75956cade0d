"""Small @triton.jit helpers shared by the kernels."""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import configs

# On the GPU, tl.log / tl.math.log2 become the MUFU's approximate lg2 (a few ulps off); the LSE is an
# output users compare and merge, so its one log per row goes through libdevice's accurate log. The
# interpreter has no libdevice, and its tl.log is numpy's (already accurate).
PRECISE_LOG = tl.constexpr(not configs.INTERPRET)


@triton.jit
def natural_log(x, PRECISE: tl.constexpr):
    """ln(x), elementwise, accurate to about an ulp on the GPU when PRECISE."""
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)
