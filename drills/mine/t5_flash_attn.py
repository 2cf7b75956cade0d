# Your copy of this drill. Write the bodies marked TODO, then run
#     python -m pytest drills/tests/test_t5_flash_attn.py
# The lesson: drills/content/en/t5_flash_attn.md (中文: drills/content/zh/t5_flash_attn.md).
# Reset this file to the untouched stub: python drills/make_mine.py --only t5_flash_attn
"""T5: the FlashAttention forward, O = softmax(Q K^T * scale) V, on [B, H, S, D].

One program per (query block, batch*head), a 2-D grid. The program loads its Q tile once, then streams
K and V past it in blocks of BLOCK_N keys: K is read already transposed through its strides, the scores
of a block are one tl.dot, the softmax is online (running max m, running sum l, fp32 accumulator acc,
all in exp2 with log2(e) folded into the scale), and p @ V is a second tl.dot. The S x S scores never
touch memory: the output and one log-sum-exp per row are the only writes.

Causal: keys after the query block's last row are never visited (the loop bound is the end of the
query block, not of a key block), keys before the first row's block need no mask, only the blocks that
cross the diagonal are masked element by element; the loop is split in two for that.
Lesson: drills/content/{en,zh}/t5_flash_attn.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from drill_common import dot_operand, require_written, upcast_for_dot


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i,                      # running state: [BLOCK_M, HEAD_DIM], [BLOCK_M], [BLOCK_M] fp32
    q,                                  # [BLOCK_M, HEAD_DIM], the program's query tile
    k_base, v_base, stride_ks, stride_vs,
    offs_m, offs_n, offs_d,             # [BLOCK_M] query positions, [BLOCK_N] 0..BLOCK_N-1, [HEAD_DIM]
    lo, hi, SEQ, qk_scale,              # visit key blocks starting at lo, lo + BLOCK_N, ... < hi
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    """Fold the key blocks [lo, hi) into (acc, l_i, m_i). MASKED: the blocks may hold keys >= SEQ or
    (CAUSAL) keys after some query row, so loads and scores are masked; otherwise no mask at all.
    m_i is kept in raw score units (q . k before any scale)."""
    # TODO: write this function. What it computes:
    # for start_n in range(lo, hi, BLOCK_N):
    # 1. cols = start_n + offs_n; load k^T [HEAD_DIM, BLOCK_N] (cols along the columns, so tl.dot(q, kT)
    #    needs no transpose) and v [BLOCK_N, HEAD_DIM]; when MASKED, keys >= SEQ load as 0
    # 2. s = tl.dot(q, kT) (raw scores, fp32 [BLOCK_M, BLOCK_N]); when MASKED set s = -inf where
    #    cols >= SEQ or (CAUSAL and cols > offs_m)
    # 3. m_new = max(m_i, row max of s); alpha = exp2((m_i - m_new) * qk_scale);
    #    p = exp2(s * qk_scale - m_new * qk_scale)   (p from the NEW max)
    # 4. l_i = l_i * alpha + row sum of p; acc = acc * alpha + tl.dot(p in v's dtype, v); m_i = m_new
    # return acc, l_i, m_i
    # Delete the line below when you start; the tests will then run your code.
    tl.static_assert(False, "_attn_fwd_inner: not written yet")


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE,                    # q, k, v, o [B, H, S, D] fp16/bf16; lse [B, H, S] fp32 (contiguous)
    stride_qb, stride_qh, stride_qs,    # strides in elements; head_dim stride is 1 for q, k, v and o
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    H, SEQ, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (start_m, bh): rows start_m * BLOCK_M + arange(BLOCK_M) of head (b, h) = divmod(bh, H):
    o[b, h, rows] = softmax(q K^T * sm_scale) V over the visible keys, lse[b, h, rows] = natural-log
    log-sum-exp of the scaled scores. Two calls of _attn_fwd_inner: unmasked blocks, then masked ones."""
    # TODO: write this function. What it computes:
    # 1. start_m, bh = program ids 0, 1; b, h = bh // H, bh % H; int64 base offsets of (b, h) in q, k, v, o
    # 2. offs_m = start_m * BLOCK_M + arange(BLOCK_M); offs_n = arange(BLOCK_N); offs_d = arange(HEAD_DIM)
    # 3. load the q tile [BLOCK_M, HEAD_DIM] once (rows >= SEQ as 0); m_i = -inf, l_i = 0, acc = 0 (fp32);
    #    qk_scale = sm_scale * log2(e)
    # 4. key ranges: causal: hi = min((start_m + 1) * BLOCK_M, SEQ), lo = start_m * BLOCK_M rounded down
    #    to a multiple of BLOCK_N; otherwise hi = SEQ, lo = SEQ rounded down to a multiple of BLOCK_N
    # 5. _attn_fwd_inner over [0, lo) with MASKED=False, then over [lo, hi) with MASKED=True
    # 6. o = acc / l_i (in o's dtype), lse = (m_i * qk_scale + log2(l_i)) * ln(2); store rows < SEQ
    # Delete the line below when you start; the tests will then run your code.
    tl.static_assert(False, "_attn_fwd_kernel: not written yet")
    # [/drill:t5:epilogue]


# [drill:t5:host]
def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
               sm_scale: float | None = None, block_m: int = 64, block_n: int = 64,
               return_lse: bool = False):
    """q, k, v [B, H, S, D] fp16/bf16 with a contiguous last dim (any other strides), D a power of two
    in 16..128. Returns o [B, H, S, D] (and lse [B, H, S] fp32, natural log, with return_lse)."""
    require_written(_attn_fwd_kernel, _attn_fwd_inner, where="drills/mine/t5_flash_attn.py")
    B, H, S, D = q.shape
    assert k.shape == q.shape and v.shape == q.shape, "q, k, v: expected the same [B, H, S, D]"
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype
    assert D in (16, 32, 64, 128), f"head_dim: expected a power of two in 16..128, got {D}"
    assert q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1, "head_dim must be contiguous"
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(S, block_m), B * H)
    _attn_fwd_kernel[grid](q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                           *o.stride()[:3], H, S, sm_scale, HEAD_DIM=D, BLOCK_M=block_m,
                           BLOCK_N=block_n, CAUSAL=causal, UPCAST=upcast_for_dot(q.dtype),
                           num_warps=4, num_stages=2)
    return (o, lse) if return_lse else o
# [/drill:t5:host]
