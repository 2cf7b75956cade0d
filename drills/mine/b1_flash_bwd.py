# Your copy of this drill. Write the bodies marked TODO, then run
#     python -m pytest drills/tests/test_b1_flash_bwd.py
# The lesson: drills/content/en/b1_flash_bwd.md (中文: drills/content/zh/b1_flash_bwd.md).
# Reset this file to the untouched stub: python drills/make_mine.py --only b1_flash_bwd
"""B1: the FlashAttention backward on [B, H, S, D] (T5's semantics), in three kernels.

Given dO (the gradient of O), the forward's O and its natural-log LSE, and P = exp(S * scale - lse)
rebuilt block by block (never stored):

    dV = P^T dO
    dP = dO V^T
    dS = P * (dP - delta),   delta = rowsum(dO * O)   (one number per query row)
    dQ = scale * dS K
    dK = scale * dS^T Q

1. _bwd_preprocess_kernel: delta per query row.
2. _bwd_dkdv_kernel: a program owns one block of keys, keeps its K, V and dK, dV accumulators on chip
   and walks over the query blocks that see it.
3. _bwd_dq_kernel: a program owns one block of queries and walks over the keys, as the forward does.
No atomics: every output element is written by exactly one program, so results are deterministic.
For brevity every block is masked here (T5's unmasked/masked split is left as an exercise).
Lesson: drills/content/{en,zh}/b1_flash_bwd.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from drill_common import dot_operand, require_written, upcast_for_dot


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DELTA,                       # o, do [B, H, S, D] (contiguous); delta [B, H, S] fp32
    SEQ,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Program (start_m, bh): delta[bh, rows] = sum_d o[bh, rows, d] * do[bh, rows, d] in fp32."""
    # TODO: write this function. What it computes:
    # 1. start_m, bh = program ids; rows = start_m * BLOCK_M + arange; base = bh * SEQ * HEAD_DIM (int64)
    # 2. load o and do tiles [BLOCK_M, HEAD_DIM] (rows >= SEQ as 0), widen to fp32
    # 3. store the row sums of o * do into delta[bh * SEQ + rows], rows < SEQ
    # Delete the line below when you start; the tests will then run your code.
    tl.static_assert(False, "_bwd_preprocess_kernel: not written yet")
    # [/drill:b1:delta]


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,    # q, k, v, do, dk, dv [B, H, S, D] contiguous; lse, delta [B, H, S] fp32
    SEQ, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (start_n, bh): for keys cols = start_n * BLOCK_N + arange(BLOCK_N) of head bh,
    dv[cols] = sum over query blocks of P^T dO and dk[cols] = scale * sum of dS^T Q, where the tiles are
    kept transposed ([BLOCK_N, BLOCK_M]) so that every product has the key block on the left."""
    # TODO: write this function. What it computes:
    # 1. start_n, bh = program ids; cols = start_n * BLOCK_N + arange; base = bh * SEQ * HEAD_DIM (int64)
    # 2. load k, v [BLOCK_N, HEAD_DIM] once; dk, dv = 0 (fp32); qk_scale = sm_scale * log2(e)
    # 3. first query block: causal: start_n * BLOCK_N rounded down to a multiple of BLOCK_M (no earlier
    #    query sees these keys); otherwise 0. Loop over query blocks up to SEQ:
    #    load q^T [HEAD_DIM, BLOCK_M] through strides, do [BLOCK_M, HEAD_DIM], lse, delta [BLOCK_M]
    #    sT = k @ q^T; pT = exp2(sT * qk_scale - lse * log2(e)); 0 where the row >= SEQ or (causal) key > row
    #    dv += pT @ do; dpT = v @ do^T; dsT = pT * (dpT - delta); dk += dsT @ q   (pT, dsT in the input dtype)
    # 4. store dk * sm_scale and dv for cols < SEQ
    # Delete the line below when you start; the tests will then run your code.
    tl.static_assert(False, "_bwd_dkdv_kernel: not written yet")
    # [/drill:b1:dkdv-store]


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,        # as above; dq [B, H, S, D]
    SEQ, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (start_m, bh): dq[rows] = scale * sum over key blocks of dS K, dS = P * (dO V^T - delta)."""
    # TODO: write this function. What it computes:
    # 1. start_m, bh = program ids; rows = start_m * BLOCK_M + arange; base as above
    # 2. load q, do [BLOCK_M, HEAD_DIM], lse (times log2(e)) and delta [BLOCK_M] once; dq = 0 (fp32)
    # 3. key blocks up to hi (causal: min((start_m + 1) * BLOCK_M, SEQ), else SEQ):
    #    load k^T and v^T [HEAD_DIM, BLOCK_N] through strides; s = q @ k^T; p = exp2(s * qk_scale - lse2),
    #    0 where the key >= SEQ or (causal) key > row; dp = do @ v^T; ds = p * (dp - delta); dq += ds @ k
    # 4. store dq * sm_scale for rows < SEQ
    # Delete the line below when you start; the tests will then run your code.
    tl.static_assert(False, "_bwd_dq_kernel: not written yet")
    # [/drill:b1:dq]


# [drill:b1:host]
def flash_attn_backward(do, q, k, v, o, lse, causal: bool = False, sm_scale: float | None = None,
                        block_m: int = 32, block_n: int = 32):
    """do, q, k, v, o [B, H, S, D] fp16/bf16; lse [B, H, S] fp32 (natural log, from the forward).
    Returns dq, dk, dv [B, H, S, D]. Inputs are made contiguous (one set of strides for all)."""
    require_written(_bwd_preprocess_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel, where="drills/mine/b1_flash_bwd.py")
    do, q, k, v, o = (t.contiguous() for t in (do, q, k, v, o))
    lse = lse.float().contiguous()
    B, H, S, D = q.shape
    assert D in (16, 32, 64, 128) and k.shape == q.shape and v.shape == q.shape
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    delta = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    up = upcast_for_dot(q.dtype)
    _bwd_preprocess_kernel[(triton.cdiv(S, block_m), B * H)](o, do, delta, S, HEAD_DIM=D, BLOCK_M=block_m)
    _bwd_dkdv_kernel[(triton.cdiv(S, block_n), B * H)](
        q, k, v, do, lse, delta, dk, dv, S, sm_scale, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, UPCAST=up)
    _bwd_dq_kernel[(triton.cdiv(S, block_m), B * H)](
        q, k, v, do, lse, delta, dq, S, sm_scale, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, UPCAST=up)
    return dq, dk, dv
# [/drill:b1:host]
