# Your copy of this drill. Write the bodies marked TODO, then run
#     python -m pytest drills/tests/test_t4_scores.py
# The lesson: drills/content/en/t4_scores.md (中文: drills/content/zh/t4_scores.md).
# Reset this file to the untouched stub: python drills/make_mine.py --only t4_scores
"""T4 (warm-up): attention scores S = Q K^T * scale on [B, H, S, D], K read transposed through strides.

The bridge from T3 to T5: the same tile product, but now with the attention layout (a base offset per
(batch, head), computed in int64), a whole head_dim per tile (HEAD_DIM is the shared dimension, so there
is no k-loop), and K^T read straight from K's memory by swapping which index walks which stride.
The output is the S x S matrix that T5 will never write: this drill writes it so that you can see it.
Lesson: drills/content/{en,zh}/t4_scores.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from drill_common import dot_operand, require_written, upcast_for_dot


@triton.jit
def _scores_kernel(
    Q, K, S_out,                        # q [B, H, Sq, D], k [B, H, Sk, D] fp16/bf16; s [B, H, Sq, Sk] fp32
    stride_qb, stride_qh, stride_qs,    # strides in elements; head_dim stride is 1 for q and k
    stride_kb, stride_kh, stride_ks,
    stride_sb, stride_sh, stride_sm,    # s's last stride is 1
    H, SEQ_Q, SEQ_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (pid_m, pid_n, bh): s[b, h, rows, cols] = (q[b, h, rows, :] @ k[b, h, cols, :]^T) * sm_scale,
    with rows = pid_m * BLOCK_M + arange(BLOCK_M), cols likewise, out-of-range rows/cols masked."""
    # TODO: write this function. What it computes:
    # 1. pid_m, pid_n, bh = program ids 0, 1, 2; b, h = bh // H, bh % H
    # 2. int64 base offsets of (b, h) in q, k and s
    # 3. load q tile [BLOCK_M, HEAD_DIM]; load k^T tile [HEAD_DIM, BLOCK_N] directly:
    #    address = base + cols[None, :] * stride_ks + d[:, None]   (columns = key positions)
    # 4. s = tl.dot(q, kT) * sm_scale (fp32); store where rows < SEQ_Q and cols < SEQ_K
    # Delete the line below when you start; the tests will then run your code.
    tl.static_assert(False, "_scores_kernel: not written yet")
    # [/drill:t4:dot]


# [drill:t4:host]
def scores(q: torch.Tensor, k: torch.Tensor, sm_scale: float | None = None,
           block_m: int = 32, block_n: int = 32) -> torch.Tensor:
    """q [B, H, Sq, D], k [B, H, Sk, D] (head_dim contiguous, D a power of two >= 16)
    -> fp32 [B, H, Sq, Sk] = q @ k^T * sm_scale (default 1/sqrt(D))."""
    require_written(_scores_kernel, where="drills/mine/t4_scores.py")
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    assert k.shape == (B, H, Sk, D) and q.stride(3) == 1 and k.stride(3) == 1
    assert D >= 16 and D & (D - 1) == 0, "head_dim: expected a power of two >= 16"
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    s = torch.empty(B, H, Sq, Sk, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(Sq, block_m), triton.cdiv(Sk, block_n), B * H)
    _scores_kernel[grid](q, k, s, *q.stride()[:3], *k.stride()[:3], *s.stride()[:3],
                         H, Sq, Sk, sm_scale, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
                         UPCAST=upcast_for_dot(q.dtype))
    return s
# [/drill:t4:host]
