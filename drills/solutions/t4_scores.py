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
    # Plan:
    # 1. pid_m, pid_n, bh = program ids 0, 1, 2; b, h = bh // H, bh % H
    # 2. int64 base offsets of (b, h) in q, k and s
    # 3. load q tile [BLOCK_M, HEAD_DIM]; load k^T tile [HEAD_DIM, BLOCK_N] directly:
    #    address = base + cols[None, :] * stride_ks + d[:, None]   (columns = key positions)
    # 4. s = tl.dot(q, kT) * sm_scale (fp32); store where rows < SEQ_Q and cols < SEQ_K
    # [drill:t4:program]
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bh = tl.program_id(2)
    off_b = bh // H
    off_h = bh % H
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b.to(tl.int64) * stride_kb + off_h.to(tl.int64) * stride_kh
    s_base = S_out + off_b.to(tl.int64) * stride_sb + off_h.to(tl.int64) * stride_sh
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                          # [BLOCK_M] query positions
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                          # [BLOCK_N] key positions
    offs_d = tl.arange(0, HEAD_DIM)                                         # [HEAD_DIM]
    # [/drill:t4:program]
    # [drill:t4:loads]
    q = tl.load(q_base + rows[:, None] * stride_qs + offs_d[None, :],
                mask=rows[:, None] < SEQ_Q, other=0.0)                      # [BLOCK_M, HEAD_DIM]
    kT = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None],
                 mask=cols[None, :] < SEQ_K, other=0.0)                     # [HEAD_DIM, BLOCK_N]
    # [/drill:t4:loads]
    # [drill:t4:dot]
    s = tl.dot(dot_operand(q, UPCAST), dot_operand(kT, UPCAST)) * sm_scale   # [BLOCK_M, BLOCK_N] fp32
    tl.store(s_base + rows[:, None] * stride_sm + cols[None, :], s,
             mask=(rows[:, None] < SEQ_Q) & (cols[None, :] < SEQ_K))
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
