# Your copy of this drill. Write the bodies marked TODO, then run
#     python -m pytest drills/tests/test_t2_online_softmax.py
# The lesson: drills/content/en/t2_online_softmax.md (中文: drills/content/zh/t2_online_softmax.md).
# Reset this file to the untouched stub: python drills/make_mine.py --only t2_online_softmax
"""T2 (warm-up): the online softmax of a row seen one block at a time.

The row is longer than one block (think: the keys of attention, which never fit on chip). Pass 1 walks
the blocks once and keeps two running numbers, m (largest value so far) and l (sum of exp(x - m) so
far), rescaling l whenever m grows. Pass 2 writes exp(x - m) / l. The row's log-sum-exp,
lse = m + log(l), is stored too: attention's backward and the split-KV merge are built on it.
Lesson: drills/content/{en,zh}/t2_online_softmax.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drill_common import require_written


@triton.jit
def _online_softmax_kernel(
    X, Y, LSE,                  # x [M, N], y [M, N] (x's dtype), lse [M] fp32
    stride_xm, stride_ym,       # row strides (elements); the column stride is 1
    N,                          # row length (any size; many blocks)
    BLOCK_N: tl.constexpr,      # block width, a power of two, usually much smaller than N
):
    """Program i: y[i] = softmax(x[i]) and lse[i] = log(sum_j exp(x[i, j])), reading x[i] in blocks of
    BLOCK_N with the running max m and running sum l (pass 1), then normalising (pass 2)."""
    # TODO: write this function. What it computes:
    # 1. row = program id 0; int64 row base pointers
    # 2. m = -inf, l = 0 (fp32 scalars)
    # 3. pass 1, for each block of BLOCK_N columns: load (masked lanes -inf), m_new = max(m, block max),
    #    l = l * exp(m - m_new) + sum(exp(x - m_new)), m = m_new
    # 4. store lse = m + log(l)
    # 5. pass 2, for each block: store exp(x - m) / l in y's dtype (masked lanes not stored)
    # Delete the line below when you start; the tests will then run your code.
    tl.static_assert(False, "_online_softmax_kernel: not written yet")
    # [/drill:t2:pass2]


# [drill:t2:host]
def online_softmax(x: torch.Tensor, block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(x, -1), logsumexp(x, -1) in fp32) of a 2-D x with a contiguous last dim and N >= 1."""
    require_written(_online_softmax_kernel, where="drills/mine/t2_online_softmax.py")
    assert x.ndim == 2 and x.stride(1) == 1 and x.shape[1] >= 1, "x: expected [M, N >= 1], last dim contiguous"
    M, N = x.shape
    y = torch.empty_like(x)
    lse = torch.empty(M, dtype=torch.float32, device=x.device)
    _online_softmax_kernel[(M,)](x, y, lse, x.stride(0), y.stride(0), N, BLOCK_N=block_n)
    return y, lse
# [/drill:t2:host]
