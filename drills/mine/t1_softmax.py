# Your copy of this drill. Write the bodies marked TODO, then run
#     python -m pytest drills/tests/test_t1_softmax.py
# The lesson: drills/content/en/t1_softmax.md (中文: drills/content/zh/t1_softmax.md).
# Reset this file to the untouched stub: python drills/make_mine.py --only t1_softmax
"""T1 (warm-up): fused row softmax. One program per row; the whole row fits in one block.

softmax(x)[i, j] = exp(x[i, j] - max_j x[i, :]) / sum_j exp(x[i, j] - max_j x[i, :])

PyTorch's eager version reads x, writes and re-reads intermediates; the fused kernel reads each
element once and writes each result once. Lesson: drills/content/{en,zh}/t1_softmax.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drill_common import next_pow2, require_written


@triton.jit
def _softmax_kernel(
    X, Y,                       # x [M, N] (any dtype), y [M, N] (same dtype)
    stride_xm, stride_ym,       # row strides (elements); the column stride is 1
    N,                          # row length
    BLOCK_N: tl.constexpr,      # a power of two >= N: the whole row in one block
):
    """Program i computes row i of y = softmax(x, dim=-1), in fp32, stored in y's dtype."""
    # TODO: write this function. What it computes:
    # 1. row = program id 0; base pointers of that row in X and Y (int64: M * stride can pass 2^31)
    # 2. load the row as BLOCK_N lanes, lanes >= N masked to -inf (they must not win the max nor add
    #    to the sum), widen to fp32
    # 3. subtract the row max, exp, divide by the sum (lanes >= N give exp(-inf) = 0)
    # 4. store the N valid lanes in y's dtype
    # Delete the line below when you start; the tests will then run your code.
    tl.static_assert(False, "_softmax_kernel: not written yet")
    # [/drill:t1:store]


# [drill:t1:host]
def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of a 2-D tensor whose last dim is contiguous."""
    require_written(_softmax_kernel, where="drills/mine/t1_softmax.py")
    assert x.ndim == 2 and x.stride(1) == 1, "x: expected [M, N] with a contiguous last dim"
    M, N = x.shape
    y = torch.empty_like(x)
    _softmax_kernel[(M,)](x, y, x.stride(0), y.stride(0), N, BLOCK_N=next_pow2(N))
    return y
# [/drill:t1:host]
