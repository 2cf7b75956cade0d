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
    # Plan:
    # 1. start_m, bh = program ids; rows = start_m * BLOCK_M + arange; base = bh * SEQ * HEAD_DIM (int64)
    # 2. load o and do tiles [BLOCK_M, HEAD_DIM] (rows >= SEQ as 0), widen to fp32
    # 3. store the row sums of o * do into delta[bh * SEQ + rows], rows < SEQ
    # [drill:b1:delta]
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)                        # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM)
    offs = bh * SEQ * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]   # [BLOCK_M, HEAD_DIM]
    o = tl.load(O + offs, mask=rows[:, None] < SEQ, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=rows[:, None] < SEQ, other=0.0).to(tl.float32)
    tl.store(DELTA + bh * SEQ + rows, tl.sum(o * do, axis=1), mask=rows < SEQ)
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
    # Plan:
    # 1. start_n, bh = program ids; cols = start_n * BLOCK_N + arange; base = bh * SEQ * HEAD_DIM (int64)
    # 2. load k, v [BLOCK_N, HEAD_DIM] once; dk, dv = 0 (fp32); qk_scale = sm_scale * log2(e)
    # 3. first query block: causal: start_n * BLOCK_N rounded down to a multiple of BLOCK_M (no earlier
    #    query sees these keys); otherwise 0. Loop over query blocks up to SEQ:
    #    load q^T [HEAD_DIM, BLOCK_M] through strides, do [BLOCK_M, HEAD_DIM], lse, delta [BLOCK_M]
    #    sT = k @ q^T; pT = exp2(sT * qk_scale - lse * log2(e)); 0 where the row >= SEQ or (causal) key > row
    #    dv += pT @ do; dpT = v @ do^T; dsT = pT * (dpT - delta); dk += dsT @ q   (pT, dsT in the input dtype)
    # 4. store dk * sm_scale and dv for cols < SEQ
    # [drill:b1:dkdv-setup]
    start_n = tl.program_id(0)
    base = tl.program_id(1).to(tl.int64) * SEQ * HEAD_DIM
    row_base = tl.program_id(1).to(tl.int64) * SEQ                          # into lse and delta
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)                        # [BLOCK_N] key positions
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_offs = base + cols[:, None] * HEAD_DIM + offs_d[None, :]             # [BLOCK_N, HEAD_DIM]
    k = tl.load(K + kv_offs, mask=cols[:, None] < SEQ, other=0.0)
    v = tl.load(V + kv_offs, mask=cols[:, None] < SEQ, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    lo = (start_n * BLOCK_N) // BLOCK_M * BLOCK_M if CAUSAL else 0
    # [/drill:b1:dkdv-setup]
    # [drill:b1:dkdv-loop]
    for start_m in range(lo, SEQ, BLOCK_M):
        rows = start_m + offs_m                                             # [BLOCK_M] query positions
        qT = tl.load(Q + base + rows[None, :] * HEAD_DIM + offs_d[:, None],
                     mask=rows[None, :] < SEQ, other=0.0)                   # [HEAD_DIM, BLOCK_M]
        do = tl.load(DO + base + rows[:, None] * HEAD_DIM + offs_d[None, :],
                     mask=rows[:, None] < SEQ, other=0.0)                   # [BLOCK_M, HEAD_DIM]
        lse2 = tl.load(LSE + row_base + rows, mask=rows < SEQ, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + row_base + rows, mask=rows < SEQ, other=0.0)
        sT = tl.dot(dot_operand(k, UPCAST), dot_operand(qT, UPCAST))        # [BLOCK_N, BLOCK_M] raw
        pT = tl.exp2(sT * qk_scale - lse2[None, :])
        visible = rows[None, :] < SEQ
        if CAUSAL:
            visible = visible & (cols[:, None] <= rows[None, :])
        pT = tl.where(visible, pT, 0.0)
        dv += tl.dot(dot_operand(pT.to(do.dtype), UPCAST), dot_operand(do, UPCAST))
        dpT = tl.dot(dot_operand(v, UPCAST), dot_operand(tl.trans(do), UPCAST))   # [BLOCK_N, BLOCK_M]
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dot_operand(dsT.to(qT.dtype), UPCAST), dot_operand(tl.trans(qT), UPCAST))
    # [/drill:b1:dkdv-loop]
    # [drill:b1:dkdv-store]
    tl.store(DK + kv_offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=cols[:, None] < SEQ)
    tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=cols[:, None] < SEQ)
    # [/drill:b1:dkdv-store]


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,        # as above; dq [B, H, S, D]
    SEQ, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (start_m, bh): dq[rows] = scale * sum over key blocks of dS K, dS = P * (dO V^T - delta)."""
    # Plan:
    # 1. start_m, bh = program ids; rows = start_m * BLOCK_M + arange; base as above
    # 2. load q, do [BLOCK_M, HEAD_DIM], lse (times log2(e)) and delta [BLOCK_M] once; dq = 0 (fp32)
    # 3. key blocks up to hi (causal: min((start_m + 1) * BLOCK_M, SEQ), else SEQ):
    #    load k^T and v^T [HEAD_DIM, BLOCK_N] through strides; s = q @ k^T; p = exp2(s * qk_scale - lse2),
    #    0 where the key >= SEQ or (causal) key > row; dp = do @ v^T; ds = p * (dp - delta); dq += ds @ k
    # 4. store dq * sm_scale for rows < SEQ
    # [drill:b1:dq]
    start_m = tl.program_id(0)
    base = tl.program_id(1).to(tl.int64) * SEQ * HEAD_DIM
    row_base = tl.program_id(1).to(tl.int64) * SEQ
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_offs = base + rows[:, None] * HEAD_DIM + offs_d[None, :]              # [BLOCK_M, HEAD_DIM]
    q = tl.load(Q + q_offs, mask=rows[:, None] < SEQ, other=0.0)
    do = tl.load(DO + q_offs, mask=rows[:, None] < SEQ, other=0.0)
    lse2 = tl.load(LSE + row_base + rows, mask=rows < SEQ, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + row_base + rows, mask=rows < SEQ, other=0.0)
    qk_scale = sm_scale * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = tl.minimum((start_m + 1) * BLOCK_M, SEQ) if CAUSAL else SEQ
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        t_offs = base + cols[None, :] * HEAD_DIM + offs_d[:, None]          # [HEAD_DIM, BLOCK_N]
        kT = tl.load(K + t_offs, mask=cols[None, :] < SEQ, other=0.0)
        vT = tl.load(V + t_offs, mask=cols[None, :] < SEQ, other=0.0)
        s = tl.dot(dot_operand(q, UPCAST), dot_operand(kT, UPCAST))         # [BLOCK_M, BLOCK_N] raw
        p = tl.exp2(s * qk_scale - lse2[:, None])
        visible = cols[None, :] < SEQ
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        p = tl.where(visible, p, 0.0)
        dp = tl.dot(dot_operand(do, UPCAST), dot_operand(vT, UPCAST))       # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])
        dq += tl.dot(dot_operand(ds.to(kT.dtype), UPCAST), dot_operand(tl.trans(kT), UPCAST))
    tl.store(DQ + q_offs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None] < SEQ)
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
