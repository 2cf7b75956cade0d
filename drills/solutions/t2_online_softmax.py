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
    # Plan:
    # 1. row = program id 0; int64 row base pointers
    # 2. m = -inf, l = 0 (fp32 scalars)
    # 3. pass 1, for each block of BLOCK_N columns: load (masked lanes -inf), m_new = max(m, block max),
    #    l = l * exp(m - m_new) + sum(exp(x - m_new)), m = m_new
    # 4. store lse = m + log(l)
    # 5. pass 2, for each block: store exp(x - m) / l in y's dtype (masked lanes not stored)
    # [drill:t2:setup]
    row = tl.program_id(0)
    x_row = X + row.to(tl.int64) * stride_xm
    y_row = Y + row.to(tl.int64) * stride_ym
    cols = tl.arange(0, BLOCK_N)                                             # [BLOCK_N]
    m = tl.full((), float("-inf"), dtype=tl.float32)    # largest x seen so far
    l = tl.zeros((), dtype=tl.float32)                  # sum of exp(x - m) over x seen so far
    # [/drill:t2:setup]
    # [drill:t2:pass1]
    for start in range(0, N, BLOCK_N):
        x = tl.load(x_row + start + cols, mask=start + cols < N, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # Old terms were exp(x - m); under the new max they are exp(x - m_new) = exp(x - m) * alpha.
        # First block: m = -inf, alpha = exp(-inf) = 0 (m_new is finite: lane 0 is always < N).
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    # [/drill:t2:pass1]
    # [drill:t2:lse]
    tl.store(LSE + row, m + tl.log(l))
    # [/drill:t2:lse]
    # [drill:t2:pass2]
    inv_l = 1.0 / l
    for start in range(0, N, BLOCK_N):
        mask = start + cols < N
        x = tl.load(x_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        y = tl.exp(x - m) * inv_l                                            # [BLOCK_N]
        tl.store(y_row + start + cols, y.to(Y.dtype.element_ty), mask=mask)
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
