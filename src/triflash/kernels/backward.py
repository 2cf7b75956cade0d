"""FlashAttention-2 backward: preprocess, dK/dV and dQ kernels, and their launcher.

With P = softmax(S * scale) recomputed from the saved LSE (no S x S tensor is ever stored):

    dV = P^T dO                 dP = dO V^T
    dS = P * (dP - delta)       delta = rowsum(dO * O)   (minus dLSE when the LSE itself gets a gradient)
    dQ = scale * dS K           dK = scale * dS^T Q

Three launches, no atomics, so the result is bit-for-bit deterministic:

1. ``_bwd_preprocess_kernel``: delta per query row, and the LSE turned into base 2 (lse * log2(e))
   so the recomputation is one FMA and one exp2 per score (fp32 keeps the natural-log LSE, see
   _recompute_p). Rows that saw no key (lse = -inf) get +inf there, which makes every recomputed p
   of that row exp2(-inf) = 0: their gradients are 0, never NaN. 2. ``_bwd_dkdv_kernel``: one
   program per (batch, KV head, key block). It keeps K, V, dK, dV of its block in registers and
   walks over the query blocks of every query head in its GQA group, so dK and dV of a shared KV
   head are sums over the group without any cross-program reduction. 3. ``_bwd_dq_kernel``: one
   program per (batch, query head, query block), walking over key blocks.

Causal blocks are skipped in both loops exactly as in the forward (bottom-right alignment), and only
blocks on the diagonal or at the ragged end of the keys pay for an element mask.

[Note: atomic dQ] The non-deterministic form (the variant ``"atomic"``, or ``deterministic=False`` where
``dispatch.ATOMIC_BY_DEFAULT``; it measured slower than this deterministic one, so off) drops the dQ
kernel's second walk over the scores, which recomputes S and dP: the dK/dV kernel, compiled with
ATOMIC_DQ, adds each query block's share dS K (in fp32, unscaled) into a float32 workspace [B, Hq, Sq,
D] with ``tl.atomic_add``, as FlashAttention-2's Triton backward and FlashAttention-4 do. Also three
launches: 1. the preprocess, which zeroes the workspace too (ZERO_DQ); 2. the dK/dV kernel with
ATOMIC_DQ; 3. ``_bwd_dq_convert_kernel``: dq = sm_scale * workspace, in q's dtype (the dQ kernel's
scaling). With ATOMIC_DQ off (the default) every kernel compiles to exactly the code it had before the
flag existed. The sum over key blocks runs in whatever order the programs finish, so dQ can differ from
run to run by the float32 rounding of that sum. Against the deterministic path (the bound
tests/test_backward_atomic.py checks): all three within the backward's tolerance, 3x PyTorch's
same-dtype error against float64 plus its floor (dQ: the two sum dS K over different tiles; dK, dV: the
same arithmetic, which ptxas may contract differently in the larger kernel, as it did on the H100). Only
where all three gradients are wanted: dQ alone comes from the dQ kernel (less work than the fused loop,
and deterministic), dK/dV alone from the plain dK/dV kernel.

[Note: single-launch backward] At short sequences a backward's host time (three launches, the
stats buffer) is longer than its kernels take on the GPU. ``run_single`` launches the dK/dV kernel
with SINGLE over the dK/dV programs and, after them, the dQ kernel's programs (``_dq_program``), and
every program makes the delta and lse2 (base 2; natural for fp32) of the query rows it reads from
O, dO and the LSE itself (``_row_delta`` / ``_row_lse2``, the preprocess' arithmetic): one launch, three allocations
(the gradients). The dK/dV programs redo that per key block (one more [BM, D] tile read per step), so
it pays only at short sequences (``dispatch.single_launch_suits``). Deterministic; dense or packed
sequences (``run_varlen(single=True)``); no sinks (their gradient sums over every row).

On sm_90, where ``dispatch.backward_variant`` picks it (fp16/bf16 at head_dim 64 and 128), step 2
runs on a Gluon kernel instead (backward_hopper.py, its dK/dV-only form), and at head_dim 128 (at 64
from 4k keys) step 3 too; LSE2/Delta rows are then padded to whole 128-row tiles, and both Triton
kernels read them with that row stride (``stats_rows``). Measurements:
docs/performance-notes.md#backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs, launch
from .block_ranges import (
    causal_key_range,
    causal_mask,
    causal_query_range,
    sequence_bounds,
    window_kernel_args,
    window_key_range,
    window_query_range,
    window_visible,
)
from .common import (
    LOG2E,
    LOG2E_K,
    PLAIN,
    ScoreVariant,
    Varlen,
    add_rn,
    mul_rn,
    needs_int64_rows,
    rows_past_int32,
    score_mod,
    wide,
)
from .configs import BwdConfig
from .launch import host_descriptors, tma_compatible


@triton.jit(do_not_specialize=["seqlen_q", "rows_out", "num_m_blocks", "batch"])
def _bwd_preprocess_kernel(
    O, DO, LSE, DLSE, Delta, LSE2, DQ_ACC,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    num_heads, seqlen_q, rows_out, num_m_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
    PRECISE_P: tl.constexpr, LONG: tl.constexpr = False, ZERO_DQ: tl.constexpr = False,
    SINKS=None, SINK_PART=None, batch=1, HAS_SINKS: tl.constexpr = False,
):
    """Delta and LSE2 are [B, H, rows_out] with rows_out >= seqlen_q (the Hopper backward reads whole
    tiles of them with TMA): rows from seqlen_q on get delta = 0 and lse2 = +inf. LONG: 64-bit row
    offsets (``common.needs_int64_rows``), as in every kernel of this file. ZERO_DQ: also zero the
    atomic dQ's float32 workspace DQ_ACC [B, H, rows_out, HEAD_DIM] (its rows are the stats' rows),
    which saves the atomic path a separate fill (else DQ_ACC is None). HAS_SINKS: also this block's
    share of dsink, sum of exp(sink - lse) * delta over its rows, into SINK_PART [H, B,
    cdiv(seqlen_q, BLOCK_M)] (``_sink_grad_kernel`` adds them up)."""
    stride_os, stride_dos = wide(stride_os, LONG), wide(stride_dos, LONG)
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    pid_bh = pid // num_m_blocks
    off_b = pid_bh // num_heads
    off_h = pid_bh % num_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seqlen_q
    mask = m_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    o_ptrs = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh \
        + offs_m[:, None] * stride_os + offs_d[None, :]
    do_ptrs = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh \
        + offs_m[:, None] * stride_dos + offs_d[None, :]
    o = tl.load(o_ptrs, mask=mask, other=0.0)
    do = tl.load(do_ptrs, mask=mask, other=0.0)
    out_ok = offs_m < rows_out
    row = pid_bh.to(tl.int64) * rows_out + offs_m              # [BM] index into [B, H, rows_out]
    lse_row = pid_bh.to(tl.int64) * seqlen_q + offs_m          # [BM] index into [B, H, Sq]
    delta = _row_delta(o, do, DLSE + lse_row if HAS_DLSE else None, m_ok, HAS_DLSE)
    tl.store(Delta + row, delta, mask=out_ok)
    lse = tl.load(LSE + lse_row, mask=m_ok, other=float("-inf"))
    if HAS_SINKS:
        # Blocks of the seqlen_q rows only (not the padding to rows_out): the same shares, summed in
        # the same order, whatever the padding, so every backward path gives the same dsink bits.
        q_blocks = tl.cdiv(seqlen_q, BLOCK_M)
        if pid_m < q_blocks:
            sink = tl.load(SINKS + off_h)
            p_sink = tl.where(lse == float("-inf"), 0.0, tl.math.exp2((sink - lse) * LOG2E_K))
            tl.store(SINK_PART + (off_h * batch + off_b).to(tl.int64) * q_blocks + pid_m,
                     tl.sum(p_sink * delta, axis=0))
    tl.store(LSE2 + row, _row_lse2(lse, PRECISE_P), mask=out_ok)
    if ZERO_DQ:
        tl.store(DQ_ACC + row[:, None] * HEAD_DIM + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=out_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _row_delta(o, do, DLSE, m_ok, HAS_DLSE: tl.constexpr):
    """delta = rowsum(dO * O) of a block of rows ([BM, BD] tiles, zeros past the rows), minus the
    LSE's own gradient (DLSE: this block's [BM] rows, read where m_ok) with HAS_DLSE."""
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        # d lse / d s = p, so a gradient on the LSE folds into delta: dS = P * (dP - (delta - dlse)).
        delta -= tl.load(DLSE, mask=m_ok, other=0.0)
    return delta


@triton.jit
def _row_lse2(lse, PRECISE_P: tl.constexpr):
    """The LSE as the backward's kernels read it: base 2 for one-FMA recomputation (natural for fp32,
    see _recompute_p), and +inf for rows that saw no key (lse = -inf), whose every p is then 0."""
    if not PRECISE_P:
        lse = lse * LOG2E_K
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _recompute_p(s, lse, sm_scale, qk_scale, PRECISE_P: tl.constexpr, NATURAL: tl.constexpr = False):
    """P from raw scores and the row LSE. fp16/bf16: one FMA in base 2 (lse was turned into base 2).
    fp32: subtract in natural units first, round(s * scale) - lse, then scale by log2(e). The product
    is rounded on its own (mul_rn), exactly as the forward rounded max * scale into the LSE, so a row
    whose softmax has one term (one key) cancels to 0 and gets p = 1 exactly, like PyTorch's.
    NATURAL: s is already in natural units (softcap / ALiBi scores, common.score_mod)."""
    if NATURAL:
        if PRECISE_P:
            return tl.math.exp2((s - lse) * LOG2E_K)
        else:
            return tl.math.exp2(s * LOG2E_K - lse)
    elif PRECISE_P:
        return tl.math.exp2((mul_rn(s, sm_scale) - lse) * LOG2E_K)
    else:
        return tl.math.exp2(s * qk_scale - lse)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v,                             # [BN, BD] accumulators and the kept K/V tiles
    Q, DO, LSE2, Delta,                       # Q/DO: this (batch, query head), or 4-D descriptors (TMA)
    stride_qs, stride_dos, off_b, off_h,      # LSE2/Delta: this (batch, query head)'s rows
    offs_n, offs_d, lo, hi, seqlen_q, causal_offset, sm_scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, PRECISE_P: tl.constexpr, TMA: tl.constexpr,
    window_left=0, window_right=0, HAS_LEFT: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False,
    tanh_scale=None, softcap=None, slope=None, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
    DQ=None, stride_dqs=None, ATOMIC_DQ: tl.constexpr = False,
    O=None, stride_os=None, INLINE_STATS: tl.constexpr = False, HAS_DLSE: tl.constexpr = False,
):
    """Fold query blocks [lo, hi) into this key block's dK, dV. INLINE_STATS (the single-launch
    backward): LSE2 and Delta point at the forward's LSE and the LSE's gradient (None without
    HAS_DLSE) instead, and each query block's delta comes from its O tile (O: this (batch, query
    head), pointer loads), as the preprocess would have made them. MASKED: the causal mask, or with
    HAS_LEFT / HAS_RIGHT a local window's. SOFTCAP / ALIBI: P recomputed from the transformed scores,
    and SOFTCAP's chain rule on dS ([Note: score variants] in common.py). ATOMIC_DQ: also add each
    query block's dQ share, dS K (unscaled, as the dQ kernel's sum), into the float32 workspace DQ
    (this (batch, query head)'s rows, ``stride_dqs`` apart) with atomics: [Note: atomic dQ]."""
    d_ok = offs_d < HEAD_DIM
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)                         # [BM]
        m_ok = offs_m < seqlen_q
        if TMA:
            # Host-built [B, S, H, D] descriptors: rows past seqlen_q and lanes past HEAD_DIM read 0.
            q = Q.load([off_b, start_m, off_h, 0]).reshape(BLOCK_M, BLOCK_D)              # [BM, BD]
            do = DO.load([off_b, start_m, off_h, 0]).reshape(BLOCK_M, BLOCK_D)            # [BM, BD]
        else:
            q = tl.load(Q + offs_m[:, None] * stride_qs + offs_d[None, :],
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)      # [BM, BD]
            do = tl.load(DO + offs_m[:, None] * stride_dos + offs_d[None, :],
                         mask=m_ok[:, None] & d_ok[None, :], other=0.0)     # [BM, BD]
        if INLINE_STATS:
            o = tl.load(O + offs_m[:, None] * stride_os + offs_d[None, :],
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)      # [BM, BD]
            delta = _row_delta(o, do, Delta + offs_m if HAS_DLSE else None, m_ok, HAS_DLSE)   # [BM]
            lse2 = _row_lse2(tl.load(LSE2 + offs_m, mask=m_ok, other=float("-inf")), PRECISE_P)   # [BM]
        else:
            # Rows past seqlen_q read lse2 = +inf, so their p is 0.
            lse2 = tl.load(LSE2 + offs_m, mask=m_ok, other=float("inf"))      # [BM]
            delta = tl.load(Delta + offs_m, mask=m_ok, other=0.0)             # [BM]
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)       # [BN, BM] = (Q K^T)^T
        if SOFTCAP or ALIBI:
            s_t, t_t = score_mod(s_t, offs_m[None, :], offs_n[:, None], causal_offset, sm_scale, tanh_scale,
                                 softcap, slope, SOFTCAP, ALIBI, q.dtype != tl.float32)
            p_t = _recompute_p(s_t, lse2[None, :], sm_scale, qk_scale, PRECISE_P, True)   # [BN, BM]
        else:
            p_t = _recompute_p(s_t, lse2[None, :], sm_scale, qk_scale, PRECISE_P)   # [BN, BM]
        if MASKED:
            if HAS_LEFT or HAS_RIGHT:
                p_t = tl.where(window_visible(offs_m[None, :], offs_n[:, None], causal_offset, window_left,
                                              window_right, HAS_LEFT, HAS_RIGHT), p_t, 0.0)
            else:
                p_t = tl.where(causal_mask(offs_m[None, :], offs_n[:, None], causal_offset), p_t, 0.0)
        # fp32 (PRECISE_P): each block's sum on its own, then added (add_rn): short rounding chains.
        if PRECISE_P:
            dv = add_rn(dv, tl.dot(p_t, do, input_precision=DOT_PRECISION))
        else:
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)         # [BN, BD]
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)                 # [BN, BM]
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)                                # d(softcap tanh(x)) / dx
        if PRECISE_P:
            dk = add_rn(dk, tl.dot(ds_t, q, input_precision=DOT_PRECISION))
        else:
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)          # [BN, BD]
        if ATOMIC_DQ:
            # This block's own sum, then added (as the dQ kernel's add_rn): fp32 either way.
            if PRECISE_P:
                dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION)           # [BM, BD]
            else:
                dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=DOT_PRECISION)   # [BM, BD]
            tl.atomic_add(DQ + offs_m[:, None] * stride_dqs + offs_d[None, :], dq,
                          mask=m_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_n_blocks", "stats_rows", "num_kv_programs",
                               "num_m_blocks"])
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE2, Delta, DK, DV, DQ_ACC,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    num_heads_q, num_heads_k, kv_group_size, seqlen_q, seqlen_k, num_n_blocks, stats_rows,
    sm_scale, qk_scale, CU_Q, CU_K, window_left, window_right,
    tanh_scale, softcap, ALIBI_SLOPES, stride_ab, stride_ah,     # SOFTCAP / ALIBI (else None)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, PRECISE_P: tl.constexpr, TMA: tl.constexpr,
    VARLEN: tl.constexpr = False, LONG: tl.constexpr = False,
    HAS_LEFT: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False, ATOMIC_DQ: tl.constexpr = False,
    # The single-launch backward (SINGLE; else all None):
    O=None, LSE=None, DLSE=None, DQ=None, stride_ob=None, stride_os=None, stride_oh=None,
    stride_dqb=None, stride_dqs=None, stride_dqh=None, num_kv_programs=None, num_m_blocks=None,
    SINGLE: tl.constexpr = False, HAS_DLSE: tl.constexpr = False,
    DQ_BLOCK_M: tl.constexpr = 0, DQ_BLOCK_N: tl.constexpr = 0,
):
    """TMA: Q and DO are host-built 4-D tensor descriptors instead of pointers. HAS_LEFT / HAS_RIGHT:
    a local window, as in the forward kernel (``window_query_range``). LSE2 and Delta are
    [B, Hq, stats_rows] (stats_rows >= seqlen_q), as for the dQ kernel. VARLEN: packed sequences as
    in the forward kernel (batch strides 0, rows from CU_Q / CU_K); LSE2 and Delta are then
    [Hq, stats_rows = total_q]. ATOMIC_DQ: dQ too, added with atomics into DQ_ACC, a float32
    workspace with the stats' rows ([B, Hq, stats_rows, HEAD_DIM], varlen [Hq, total_q, HEAD_DIM])
    that the preprocess zeroed; ``_bwd_dq_convert_kernel`` scales it into dq ([Note: atomic dQ]).
    Else DQ_ACC is None and the kernel is the deterministic dK/dV-only one.

    SINGLE ([Note: single-launch backward]): the whole backward in this one launch, no preprocess.
    The first ``num_kv_programs`` programs are this kernel's dK/dV programs, the rest the dQ
    kernel's (``_dq_program`` with DQ_BLOCK_M x DQ_BLOCK_N tiles, ``num_m_blocks`` per head); each
    program makes its rows' delta and lse2 from O, dO, LSE and DLSE (float32 with the stats' rows:
    [B, Hq, stats_rows = Sq], packed [Hq, total_q]) itself. LSE2 and Delta are then None."""
    tl.static_assert(not (VARLEN and TMA), "packed sequences take pointer loads")
    tl.static_assert(not (SINGLE and (TMA or ATOMIC_DQ)), "the single launch takes pointer loads, no atomics")
    pid = tl.program_id(0)
    if SINGLE:
        if pid >= num_kv_programs:
            _dq_program(pid - num_kv_programs, Q, K, V, DO, None, None, DQ,
                        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                        stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                        stride_dqb, stride_dqs, stride_dqh,
                        num_heads_q, kv_group_size, seqlen_q, seqlen_k, num_m_blocks, stats_rows,
                        sm_scale, qk_scale, CU_Q, CU_K, window_left, window_right,
                        tanh_scale, softcap, ALIBI_SLOPES, stride_ab, stride_ah,
                        HEAD_DIM, BLOCK_D, DQ_BLOCK_M, DQ_BLOCK_N, IS_CAUSAL, DOT_PRECISION, PRECISE_P, False,
                        VARLEN, LONG, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI,
                        O, stride_ob, stride_os, stride_oh, LSE, DLSE, True, HAS_DLSE)
            return
    stride_qs, stride_ks, stride_vs = wide(stride_qs, LONG), wide(stride_ks, LONG), wide(stride_vs, LONG)
    stride_dos, stride_dks, stride_dvs = wide(stride_dos, LONG), wide(stride_dks, LONG), wide(stride_dvs, LONG)
    stride_acc = wide(HEAD_DIM, LONG) if ATOMIC_DQ else None                # DQ_ACC's row stride
    if SINGLE:
        stride_os = wide(stride_os, LONG)
    pid_n = pid % num_n_blocks
    pid_bh = pid // num_n_blocks
    off_b = pid_bh // num_heads_k
    off_hk = pid_bh % num_heads_k
    start_n = pid_n * BLOCK_N
    if VARLEN:
        # This sequence's rows: the pointers move to its first row, seqlen_q / seqlen_k become its own.
        q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(CU_Q, CU_K, off_b)
        if start_n >= seqlen_k:
            return                            # a block past this (shorter) sequence's end
        K += k_start * stride_ks
        V += k_start * stride_vs
        DK += k_start * stride_dks
        DV += k_start * stride_dvs
        Q += q_start * stride_qs
        DO += q_start * stride_dos
        if SINGLE:
            O += q_start * stride_os
    offs_n = start_n + tl.arange(0, BLOCK_N)                               # [BN] key positions
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
                + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)   # [BN, BD]
    v = tl.load(V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
                + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)   # [BN, BD]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query rows that see this key block (block_ranges). Row i sees key j when j <= i + causal_offset.
    causal_offset = seqlen_k - seqlen_q
    q_blocks_end = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    if HAS_LEFT or HAS_RIGHT:
        lo, mid_lo, mid_hi, hi = window_query_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                                    BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    else:
        lo, full_from = causal_query_range(start_n, seqlen_q, seqlen_k, q_blocks_end, BLOCK_M, BLOCK_N, IS_CAUSAL)

    # GQA: every query head of this KV head's group contributes to its dK and dV.
    for g in range(kv_group_size):
        off_h = off_hk * kv_group_size + g
        slope = None
        if ALIBI:
            slope = tl.load(ALIBI_SLOPES + off_b * stride_ab + off_h * stride_ah)
        if VARLEN:
            row0 = off_h.to(tl.int64) * stats_rows + q_start
        else:
            row0 = (off_b * num_heads_q + off_h).to(tl.int64) * stats_rows
        if TMA:
            q_src, do_src = Q, DO
        else:
            q_src = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
            do_src = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        o_src = None
        if SINGLE:
            # The row stats from the forward's outputs (see _dkdv_inner's INLINE_STATS); the LSE's
            # rows are the stats' rows (stats_rows = seqlen_q, packed: total_q).
            lse_src = LSE + row0
            delta_src = DLSE + row0 if HAS_DLSE else None
            o_src = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
        else:
            lse_src = LSE2 + row0
            delta_src = Delta + row0
        dq_src = None
        if ATOMIC_DQ:
            dq_src = DQ_ACC + row0 * HEAD_DIM                   # this (batch, query head)'s rows
        if HAS_LEFT or HAS_RIGHT:
            # A local window: masked rows at its edges, whole blocks between.
            dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src,
                                 stride_qs, stride_dos, off_b, off_h, offs_n, offs_d, lo, mid_lo, seqlen_q,
                                 causal_offset, sm_scale, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, True,
                                 DOT_PRECISION, PRECISE_P, TMA, window_left, window_right, HAS_LEFT, HAS_RIGHT,
                                 tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP,
                                 ALIBI=ALIBI, DQ=dq_src, stride_dqs=stride_acc, ATOMIC_DQ=ATOMIC_DQ,
                                 O=o_src, stride_os=stride_os, INLINE_STATS=SINGLE, HAS_DLSE=HAS_DLSE)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src,
                                 stride_qs, stride_dos, off_b, off_h, offs_n, offs_d, mid_lo, mid_hi, seqlen_q,
                                 causal_offset, sm_scale, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, False,
                                 DOT_PRECISION, PRECISE_P, TMA,
                                 tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP,
                                 ALIBI=ALIBI, DQ=dq_src, stride_dqs=stride_acc, ATOMIC_DQ=ATOMIC_DQ,
                                 O=o_src, stride_os=stride_os, INLINE_STATS=SINGLE, HAS_DLSE=HAS_DLSE)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src,
                                 stride_qs, stride_dos, off_b, off_h, offs_n, offs_d, mid_hi, hi, seqlen_q,
                                 causal_offset, sm_scale, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, True,
                                 DOT_PRECISION, PRECISE_P, TMA, window_left, window_right, HAS_LEFT, HAS_RIGHT,
                                 tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP,
                                 ALIBI=ALIBI, DQ=dq_src, stride_dqs=stride_acc, ATOMIC_DQ=ATOMIC_DQ,
                                 O=o_src, stride_os=stride_os, INLINE_STATS=SINGLE, HAS_DLSE=HAS_DLSE)
        else:
            dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src,
                                 stride_qs, stride_dos, off_b, off_h, offs_n, offs_d, lo, full_from, seqlen_q,
                                 causal_offset, sm_scale, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, IS_CAUSAL,
                                 DOT_PRECISION, PRECISE_P, TMA,
                                 tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP,
                                 ALIBI=ALIBI, DQ=dq_src, stride_dqs=stride_acc, ATOMIC_DQ=ATOMIC_DQ,
                                 O=o_src, stride_os=stride_os, INLINE_STATS=SINGLE, HAS_DLSE=HAS_DLSE)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src,
                                 stride_qs, stride_dos, off_b, off_h, offs_n, offs_d, full_from, q_blocks_end,
                                 seqlen_q, causal_offset, sm_scale, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, False,
                                 DOT_PRECISION, PRECISE_P, TMA,
                                 tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP,
                                 ALIBI=ALIBI, DQ=dq_src, stride_dqs=stride_acc, ATOMIC_DQ=ATOMIC_DQ,
                                 O=o_src, stride_os=stride_os, INLINE_STATS=SINGLE, HAS_DLSE=HAS_DLSE)

    dk *= sm_scale
    tl.store(DK + off_b.to(tl.int64) * stride_dkb + off_hk.to(tl.int64) * stride_dkh
             + offs_n[:, None] * stride_dks + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + off_b.to(tl.int64) * stride_dvb + off_hk.to(tl.int64) * stride_dvh
             + offs_n[:, None] * stride_dvs + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_inner(
    dq, q, do, lse2, delta,                   # [BM, BD] accumulator, kept tiles, [BM] row stats
    K, V, stride_ks, stride_vs, off_b, off_hk,   # K/V: this (batch, KV head), or 4-D descriptors (TMA)
    offs_m, offs_d, lo, hi, seqlen_k, causal_offset, sm_scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, PRECISE_P: tl.constexpr,
    TMA: tl.constexpr,
    window_left=0, window_right=0, HAS_LEFT: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False,
    tanh_scale=None, softcap=None, slope=None, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
):
    """Fold key blocks [lo, hi) into dQ (the variants as ``_dkdv_inner``'s)."""
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n                                             # [BN]
        if TMA:
            k = K.load([off_b, start_n, off_hk, 0]).reshape(BLOCK_N, BLOCK_D)             # [BN, BD]
            v = V.load([off_b, start_n, off_hk, 0]).reshape(BLOCK_N, BLOCK_D)             # [BN, BD]
        else:
            kv_mask = d_ok[None, :]
            if MASKED:
                kv_mask = kv_mask & (cols[:, None] < seqlen_k)
            k = tl.load(K + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)          # [BM, BN]
        if SOFTCAP or ALIBI:
            s, t = score_mod(s, offs_m[:, None], cols[None, :], causal_offset, sm_scale, tanh_scale, softcap,
                             slope, SOFTCAP, ALIBI, q.dtype != tl.float32)
            p = _recompute_p(s, lse2[:, None], sm_scale, qk_scale, PRECISE_P, True)   # [BM, BN]
        else:
            p = _recompute_p(s, lse2[:, None], sm_scale, qk_scale, PRECISE_P)  # [BM, BN]
        if MASKED:
            visible = cols[None, :] < seqlen_k
            if HAS_LEFT or HAS_RIGHT:
                visible = visible & window_visible(offs_m[:, None], cols[None, :], causal_offset, window_left,
                                                   window_right, HAS_LEFT, HAS_RIGHT)
            elif IS_CAUSAL:
                visible = visible & causal_mask(offs_m[:, None], cols[None, :], causal_offset)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)        # [BM, BN]
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        if PRECISE_P:
            dq = add_rn(dq, tl.dot(ds, k, input_precision=DOT_PRECISION))   # fp32: see _dkdv_inner
        else:
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)  # [BM, BD]
    return dq


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_m_blocks", "stats_rows"])
def _bwd_dq_kernel(
    Q, K, V, DO, LSE2, Delta, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    num_heads_q, kv_group_size, seqlen_q, seqlen_k, num_m_blocks, stats_rows,
    sm_scale, qk_scale, CU_Q, CU_K, window_left, window_right,
    tanh_scale, softcap, ALIBI_SLOPES, stride_ab, stride_ah,     # SOFTCAP / ALIBI (else None)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, PRECISE_P: tl.constexpr, TMA: tl.constexpr,
    VARLEN: tl.constexpr = False, LONG: tl.constexpr = False,
    HAS_LEFT: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
):
    """One program per (batch, query head, query block): ``_dq_program``."""
    _dq_program(tl.program_id(0), Q, K, V, DO, LSE2, Delta, DQ,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                stride_dqb, stride_dqs, stride_dqh,
                num_heads_q, kv_group_size, seqlen_q, seqlen_k, num_m_blocks, stats_rows,
                sm_scale, qk_scale, CU_Q, CU_K, window_left, window_right,
                tanh_scale, softcap, ALIBI_SLOPES, stride_ab, stride_ah,
                HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, IS_CAUSAL, DOT_PRECISION, PRECISE_P, TMA,
                VARLEN, LONG, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI,
                None, None, None, None, None, None, False, False)


@triton.jit
def _dq_program(
    pid, Q, K, V, DO, LSE2, Delta, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    num_heads_q, kv_group_size, seqlen_q, seqlen_k, num_m_blocks, stats_rows,
    sm_scale, qk_scale, CU_Q, CU_K, window_left, window_right,
    tanh_scale, softcap, ALIBI_SLOPES, stride_ab, stride_ah,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, PRECISE_P: tl.constexpr, TMA: tl.constexpr,
    VARLEN: tl.constexpr, LONG: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    O, stride_ob, stride_os, stride_oh, LSE, DLSE, INLINE_STATS: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """dQ of query block ``pid`` (of every (batch, query head)'s ``num_m_blocks``). TMA: K and V are
    host-built 4-D tensor descriptors instead of pointers. HAS_LEFT / HAS_RIGHT: a local window, with
    the forward's key ranges. LSE2 and Delta are [B, Hq, stats_rows] (stats_rows >= seqlen_q: padded
    when the Hopper dK/dV kernel reads them). VARLEN: packed sequences, as in the dK/dV kernel.
    INLINE_STATS (the single-launch backward): no LSE2 / Delta; the block's delta and lse2 come from O
    (its (batch, seq, head) strides given), LSE and DLSE (with HAS_DLSE), which have the stats' rows
    ([B, Hq, stats_rows = Sq], packed [Hq, total_q])."""
    tl.static_assert(not (VARLEN and TMA), "packed sequences take pointer loads")
    stride_qs, stride_ks, stride_vs = wide(stride_qs, LONG), wide(stride_ks, LONG), wide(stride_vs, LONG)
    stride_dos, stride_dqs = wide(stride_dos, LONG), wide(stride_dqs, LONG)
    pid_m = pid % num_m_blocks
    if IS_CAUSAL:
        pid_m = num_m_blocks - 1 - pid_m          # heaviest query blocks first
    pid_bh = pid // num_m_blocks
    off_b = pid_bh // num_heads_q
    off_h = pid_bh % num_heads_q
    off_hk = off_h // kv_group_size
    start_m = pid_m * BLOCK_M
    if VARLEN:
        # As in the dK/dV kernel; the stats are [Hq, total_q]: this head's row of this sequence.
        q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(CU_Q, CU_K, off_b)
        row0 = off_h.to(tl.int64) * stats_rows + q_start
        if start_m >= seqlen_q:
            return                            # a block past this (shorter) sequence's end
        Q += q_start * stride_qs
        DO += q_start * stride_dos
        DQ += q_start * stride_dqs
        K += k_start * stride_ks
        V += k_start * stride_vs
        if INLINE_STATS:
            O += q_start * wide(stride_os, LONG)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seqlen_q
    mask = m_ok[:, None] & (offs_d[None, :] < HEAD_DIM)

    q = tl.load(Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
                + offs_m[:, None] * stride_qs + offs_d[None, :], mask=mask, other=0.0)      # [BM, BD]
    do = tl.load(DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dos + offs_d[None, :], mask=mask, other=0.0)    # [BM, BD]
    if VARLEN:
        row = row0 + offs_m
    else:
        row = pid_bh.to(tl.int64) * stats_rows + offs_m
    if INLINE_STATS:
        # The LSE's rows are the stats' rows (stats_rows = seqlen_q, packed: total_q).
        o = tl.load(O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
                    + offs_m[:, None] * wide(stride_os, LONG) + offs_d[None, :], mask=mask, other=0.0)
        delta = _row_delta(o, do, DLSE + row if HAS_DLSE else None, m_ok, HAS_DLSE)
        lse2 = _row_lse2(tl.load(LSE + row, mask=m_ok, other=float("-inf")), PRECISE_P)
    else:
        lse2 = tl.load(LSE2 + row, mask=m_ok, other=float("inf"))
        delta = tl.load(Delta + row, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    slope = None
    if ALIBI:
        slope = tl.load(ALIBI_SLOPES + off_b * stride_ab + off_h * stride_ah)

    # Same key ranges as the forward: unmasked off-band blocks, then masked on-band blocks.
    causal_offset = seqlen_k - seqlen_q
    off_band_end, hi = causal_key_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    if TMA:
        k_src, v_src = K, V
    else:
        k_src = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
        v_src = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    if HAS_LEFT or HAS_RIGHT:
        lo, mid_lo, mid_hi, hi = window_key_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                                  BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, off_b, off_hk, offs_m,
                       offs_d, lo, mid_lo, seqlen_k, causal_offset, sm_scale, qk_scale,
                       HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, DOT_PRECISION, PRECISE_P, TMA,
                       window_left, window_right, HAS_LEFT, HAS_RIGHT,
                       tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
        dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, off_b, off_hk, offs_m,
                       offs_d, mid_lo, mid_hi, seqlen_k, causal_offset, sm_scale, qk_scale,
                       HEAD_DIM, BLOCK_D, BLOCK_N, False, IS_CAUSAL, DOT_PRECISION, PRECISE_P, TMA,
                       tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
        dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, off_b, off_hk, offs_m,
                       offs_d, mid_hi, hi, seqlen_k, causal_offset, sm_scale, qk_scale,
                       HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, DOT_PRECISION, PRECISE_P, TMA,
                       window_left, window_right, HAS_LEFT, HAS_RIGHT,
                       tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    else:
        dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, off_b, off_hk, offs_m,
                       offs_d, 0, off_band_end, seqlen_k, causal_offset, sm_scale, qk_scale,
                       HEAD_DIM, BLOCK_D, BLOCK_N, False, IS_CAUSAL, DOT_PRECISION, PRECISE_P, TMA,
                       tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
        dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, off_b, off_hk, offs_m,
                       offs_d, off_band_end, hi, seqlen_k, causal_offset, sm_scale, qk_scale,
                       HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, DOT_PRECISION, PRECISE_P, TMA,
                       tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    dq *= sm_scale
    tl.store(DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
             + offs_m[:, None] * stride_dqs + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------

def _s(t):
    """(batch, seq, head) strides of a [B, S, H, D] view."""
    return t.stride()[:3]


def _stride_args(names, strides) -> dict:
    """Keyword arguments stride_<name>b / s / h from (batch, seq, head) stride triples."""
    return {f"stride_{name}{axis}": x for name, st in zip(names, strides) for axis, x in zip("bsh", st)}


def preprocess(dout, out, lse, dlse, rows_out: int, precise_p: bool, dq_accum=None, sinks=None, dsink=None):
    """delta = rowsum(dO * O) (minus dlse) and lse2 (the LSE in base 2, or natural for fp32; +inf for
    rows that saw no key), both [B, Hq, rows_out] float32; rows from Sq on (padding for the Hopper
    kernel's whole tiles) get delta = 0 and lse2 = +inf. ``dq_accum``: the atomic dQ's float32
    workspace [B, Hq, rows_out, D], zeroed here (the same launch). ``sinks`` ([Hq] float32): their
    gradient, written into ``dsink`` ([Hq] float32), from per-block sums the same launch makes and
    ``_sink_grad_kernel`` adds up (every block of rows in parallel: a walk of one program per head
    over every row took about 0.1 ms at 4 x 4096 rows, longer than the preprocess itself)."""
    batch, seqlen_q, heads_q, head_dim = out.shape
    # One allocation for both (each allocation is host time in every backward call).
    delta, lse2 = torch.empty((2, batch, heads_q, rows_out), dtype=torch.float32, device=out.device)
    pre_block = configs.BWD_PREPROCESS_BLOCK_M
    pre_blocks = configs.cdiv(rows_out, pre_block)
    if dlse is not None:
        dlse = dlse.contiguous().float()
    parts = None
    if sinks is not None:
        parts = torch.empty((heads_q, batch * configs.cdiv(seqlen_q, pre_block)), dtype=torch.float32,
                            device=out.device)
    launch.run(
        _bwd_preprocess_kernel, (pre_blocks * batch * heads_q,),
        O=out, DO=dout, LSE=lse.contiguous(), DLSE=dlse, Delta=delta, LSE2=lse2, DQ_ACC=dq_accum,
        **_stride_args(("o", "do"), (_s(out), _s(dout))),
        num_heads=heads_q, seqlen_q=seqlen_q, rows_out=rows_out, num_m_blocks=pre_blocks,
        HEAD_DIM=head_dim, BLOCK_D=configs.head_dim_block(head_dim), BLOCK_M=pre_block,
        HAS_DLSE=dlse is not None, PRECISE_P=precise_p, LONG=needs_int64_rows(out, dout),
        ZERO_DQ=dq_accum is not None, SINKS=sinks, SINK_PART=parts, batch=batch, HAS_SINKS=sinks is not None,
    )
    if sinks is not None:
        count = parts.shape[1]
        launch.run(_sink_grad_kernel, (heads_q,), SINK_PART=parts, DSINK=dsink, parts=count,
                   BLOCK=min(triton.next_power_of_2(count), SINK_GRAD_BLOCK))
    return delta, lse2


def dq_accumulator(q, rows: int):
    """The atomic dQ's float32 workspace for q [B, Sq, Hq, D]: [B, Hq, rows, D] (rows >= Sq), the rows
    of ``preprocess``' stats; ``preprocess(..., dq_accum=)`` zeroes it."""
    batch, _, heads_q, head_dim = q.shape
    return torch.empty((batch, heads_q, rows, head_dim), dtype=torch.float32, device=q.device)


@triton.jit(do_not_specialize=["seqlen_q", "rows", "num_m_blocks"])
def _bwd_dq_convert_kernel(
    DQ_ACC, DQ, stride_dqb, stride_dqs, stride_dqh,
    num_heads, seqlen_q, rows, num_m_blocks, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, LONG: tl.constexpr = False,
):
    """dq = sm_scale * DQ_ACC in dq's dtype: the atomic dQ's last step ([Note: atomic dQ]). DQ_ACC is
    [B, H, rows, HEAD_DIM] float32 (rows >= seqlen_q), dq a [B, Sq, H, D] view; the scaling is the dQ
    kernel's (once, on the float32 sum)."""
    stride_dqs = wide(stride_dqs, LONG)
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    pid_bh = pid // num_m_blocks
    off_b = pid_bh // num_heads
    off_h = pid_bh % num_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                     # [BM]
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    row = pid_bh.to(tl.int64) * rows + offs_m                            # [BM] rows of DQ_ACC
    dq = tl.load(DQ_ACC + row[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)   # [BM, BD]
    dq *= sm_scale
    tl.store(DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
             + offs_m[:, None] * stride_dqs + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=mask)


def convert_dq(dq_accum, dq, sm_scale: float):
    """``_bwd_dq_convert_kernel``: dq [B, Sq, Hq, D] (last stride 1) from the workspace
    ``dq_accum`` [B, Hq, rows, D]."""
    batch, seqlen_q, heads_q, head_dim = dq.shape
    rows = dq_accum.shape[2]
    block = configs.BWD_PREPROCESS_BLOCK_M
    m_blocks = configs.cdiv(seqlen_q, block)
    launch.run(
        _bwd_dq_convert_kernel, (m_blocks * batch * heads_q,),
        DQ_ACC=dq_accum, DQ=dq, **_stride_args(("dq",), (_s(dq),)),
        num_heads=heads_q, seqlen_q=seqlen_q, rows=rows, num_m_blocks=m_blocks, sm_scale=sm_scale,
        HEAD_DIM=head_dim, BLOCK_D=configs.head_dim_block(head_dim), BLOCK_M=block, LONG=needs_int64_rows(dq),
    )


# The most per-block sums _sink_grad_kernel adds per step (more take several).
SINK_GRAD_BLOCK = 1024


@triton.jit(do_not_specialize=["parts"])
def _sink_grad_kernel(SINK_PART, DSINK, parts, BLOCK: tl.constexpr):
    """dsink_h = -sum over (b, i) of exp(sink_h - lse[b, h, i]) * delta[b, h, i]: the gradient of a
    sink logit ([Note: score variants] in common.py; p_sink = exp(sink - lse), and d out / d sink =
    -p_sink * out, d lse / d sink = p_sink, so delta = rowsum(dO * O) - dlse is the whole factor).
    SINK_PART [H, parts]: the preprocess' per-block sums. One program per head, a fixed summation
    order: deterministic."""
    off_h = tl.program_id(0)
    base = SINK_PART + off_h.to(tl.int64) * parts
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i0 in range(0, parts, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        acc += tl.load(base + offs, mask=offs < parts, other=0.0)
    tl.store(DSINK + off_h, -tl.sum(acc, 0))


def run_dkdv(q, k, v, dout, lse2, delta, dk, dv, sm_scale: float, causal: bool, config: BwdConfig,
             stats_rows: int, window=None, scores: ScoreVariant = PLAIN, dq_accum=None):
    """The Triton dK/dV kernel on [B, S, H, D] views (last stride 1), with ``preprocess``'s delta and
    lse2 ([B, Hq, stats_rows]). Writes dk and dv; with ``dq_accum`` (``dq_accumulator``'s workspace,
    zeroed by ``preprocess``) adds dQ into it too (ATOMIC_DQ; ``convert_dq`` then writes dq)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_k, _ = k.shape
    tma = config.tma and tma_compatible(q, dout)
    Q, DO = host_descriptors(config.block_m, configs.head_dim_block(head_dim), q, dout) if tma else (q, dout)
    _launch_dkdv(Q, k, v, DO, lse2, delta, dk, dv, [_s(t) for t in (q, k, v, dout, dk, dv)],
                 batch, heads_q, heads_k, head_dim, seqlen_q, seqlen_k, seqlen_k, stats_rows,
                 sm_scale, causal, config, q.dtype, tma, window=window, scores=scores, dq_accum=dq_accum)


def run_dq(q, k, v, dout, lse2, delta, dq, sm_scale: float, causal: bool, config: BwdConfig,
           stats_rows: int, window=None, scores: ScoreVariant = PLAIN):
    """The Triton dQ kernel, as ``run_dkdv``. Writes dq."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_k, _ = k.shape
    tma = config.tma and tma_compatible(k, v)
    K, V = host_descriptors(config.block_n, configs.head_dim_block(head_dim), k, v) if tma else (k, v)
    _launch_dq(q, K, V, dout, lse2, delta, dq, [_s(t) for t in (q, k, v, dout, dq)],
               batch, heads_q, heads_k, head_dim, seqlen_q, seqlen_k, seqlen_q, stats_rows,
               sm_scale, causal, config, q.dtype, tma, window=window, scores=scores)


def run_single(dout, q, k, v, out, lse, dlse, dq, dk, dv, sm_scale: float, causal: bool,
               config: tuple[BwdConfig, BwdConfig], window=None, scores: ScoreVariant = PLAIN):
    """The single-launch backward ([Note: single-launch backward]) on [B, S, H, D] views (last stride
    1): dq, dk and dv from one launch of ``_bwd_dkdv_kernel`` with SINGLE, no preprocess and no
    stats buffers. ``config``: (dK/dV, dQ) tiles as ``configs.backward_config`` gives them (their TMA
    flags are not used). No sinks (their gradient is a sum over every row: the preprocess' job)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_k, _ = k.shape
    dkdv_cfg, dq_cfg = config
    _launch_dkdv(q, k, v, dout, None, None, dk, dv, [_s(t) for t in (q, k, v, dout, dk, dv)],
                 batch, heads_q, heads_k, head_dim, seqlen_q, seqlen_k, seqlen_k, seqlen_q,
                 sm_scale, causal, dkdv_cfg, q.dtype, False, window=window, scores=scores,
                 single=_single_args(out, lse, dlse, dq, dq_cfg, batch, heads_q, seqlen_q, [_s(out), _s(dq)]))


def _single_args(out, lse, dlse, dq, dq_cfg: BwdConfig, batch: int, heads_q: int, max_seqlen_q: int, strides):
    """``_launch_dkdv``'s ``single``: SINGLE's keyword arguments (O, the LSE and its gradient, dq, the
    dQ programs' tiles), its dQ programs over (batch, query head, query block of the longest
    sequence), and whether O or dq need 64-bit rows. ``strides``: (batch, seq, head) of out, dq."""
    m_blocks = configs.cdiv(max_seqlen_q, dq_cfg.block_m)
    if dlse is not None:
        dlse = dlse.contiguous().float()
    kwargs = dict(
        O=out, LSE=lse.contiguous(), DLSE=dlse, DQ=dq, **_stride_args(("o", "dq"), strides),
        num_m_blocks=m_blocks, SINGLE=True, HAS_DLSE=dlse is not None,
        DQ_BLOCK_M=dq_cfg.block_m, DQ_BLOCK_N=dq_cfg.block_n)
    return kwargs, m_blocks * batch * heads_q, needs_int64_rows(out, dq)


def _launch_dkdv(Q, K, V, DO, lse2, delta, dk, dv, strides, batch, heads_q, heads_k, head_dim,
                 seqlen_q, seqlen_k, max_seqlen_k, stats_rows, sm_scale, causal, cfg, dtype, tma,
                 varlen=None, window=None, scores: ScoreVariant = PLAIN, dq_accum=None, single=None):
    """``_bwd_dkdv_kernel`` over (batch, KV head, key block of the longest sequence); ``strides``:
    the (batch, seq, head) strides of q, k, v, dout, dk, dv. ``dq_accum``: ATOMIC_DQ's workspace.
    ``single``: (SINGLE's keyword arguments, its dQ programs, whether O or dq need 64-bit rows)."""
    n_blocks = configs.cdiv(max_seqlen_k, cfg.block_n)
    cu_q, cu_k = _cu(varlen)
    # The workspace's rows are head_dim apart: 64-bit offsets where those pass 2^31 elements too.
    long = needs_int64_rows(Q, K, V, DO, dk, dv) or (
        dq_accum is not None and rows_past_int32(dq_accum.shape[2], head_dim, head_dim))
    extra, dq_programs = {}, 0
    if single is not None:
        extra, dq_programs, single_long = single
        extra = dict(extra, num_kv_programs=n_blocks * batch * heads_k)
        long = long or single_long
    launch.run(
        _bwd_dkdv_kernel, (n_blocks * batch * heads_k + dq_programs,), **extra,
        Q=Q, K=K, V=V, DO=DO, LSE2=lse2, Delta=delta, DK=dk, DV=dv, DQ_ACC=dq_accum,
        **_stride_args(("q", "k", "v", "do", "dk", "dv"), strides),
        num_heads_q=heads_q, num_heads_k=heads_k, kv_group_size=heads_q // heads_k, seqlen_q=seqlen_q,
        seqlen_k=seqlen_k, num_n_blocks=n_blocks, stats_rows=stats_rows,
        sm_scale=sm_scale, qk_scale=sm_scale * LOG2E, CU_Q=cu_q, CU_K=cu_k,
        **window_kernel_args(window), **scores.transform_kwargs(sm_scale),
        HEAD_DIM=head_dim, BLOCK_D=configs.head_dim_block(head_dim), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, IS_CAUSAL=causal, DOT_PRECISION=_precision(dtype),
        PRECISE_P=dtype == torch.float32, TMA=tma, VARLEN=varlen is not None, LONG=long,
        ATOMIC_DQ=dq_accum is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _launch_dq(Q, K, V, DO, lse2, delta, dq, strides, batch, heads_q, heads_k, head_dim,
               seqlen_q, seqlen_k, max_seqlen_q, stats_rows, sm_scale, causal, cfg, dtype, tma, varlen=None,
               window=None, scores: ScoreVariant = PLAIN):
    """``_bwd_dq_kernel`` over (batch, query head, query block of the longest sequence); ``strides``:
    the (batch, seq, head) strides of q, k, v, dout, dq."""
    m_blocks = configs.cdiv(max_seqlen_q, cfg.block_m)
    cu_q, cu_k = _cu(varlen)
    launch.run(
        _bwd_dq_kernel, (m_blocks * batch * heads_q,),
        Q=Q, K=K, V=V, DO=DO, LSE2=lse2, Delta=delta, DQ=dq,
        **_stride_args(("q", "k", "v", "do", "dq"), strides),
        num_heads_q=heads_q, kv_group_size=heads_q // heads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        num_m_blocks=m_blocks, stats_rows=stats_rows,
        sm_scale=sm_scale, qk_scale=sm_scale * LOG2E, CU_Q=cu_q, CU_K=cu_k,
        **window_kernel_args(window), **scores.transform_kwargs(sm_scale),
        HEAD_DIM=head_dim, BLOCK_D=configs.head_dim_block(head_dim), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, IS_CAUSAL=causal, DOT_PRECISION=_precision(dtype),
        PRECISE_P=dtype == torch.float32, TMA=tma, VARLEN=varlen is not None,
        LONG=needs_int64_rows(Q, K, V, DO, dq), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _cu(varlen):
    return (varlen.cu_seqlens_q, varlen.cu_seqlens_k) if varlen is not None else (None, None)


def _precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def run_varlen(dout, q, k, v, out, lse, sm_scale, causal, dlse, dq, dk, dv,
               config: tuple[BwdConfig, BwdConfig], varlen: Varlen, window=None, scores: ScoreVariant = PLAIN,
               dsink=None, atomic: bool = False, single: bool = False):
    """The Triton backward on packed sequences (see ``Varlen``): q / out / dout / dq [total_q, Hq, D],
    k / v / dk / dv [total_k, Hkv, D], lse / dlse [Hq, total_q]; the same per-block work as the
    padded case. dq / dk / dv are those to compute, or None; ``dsink`` ([Hq] float32) is written
    when ``scores`` has sinks. ``atomic`` (all three computed): dQ is added by the dK/dV kernel with
    atomics ([Note: atomic dQ]) instead of computed by the dQ kernel. ``single`` (all three computed, no
    sinks): the single launch ([Note: single-launch backward])."""
    total_q, heads_q, head_dim = q.shape
    total_k, heads_k, _ = k.shape
    grads = [t for t in (dq, dk, dv) if t is not None]
    if total_q == 0 or total_k == 0 or heads_q == 0:
        for t in grads:
            t.zero_()                  # no score exists
        if scores.sinks is None:
            return
        if total_q == 0 or heads_q == 0:
            dsink.zero_()
            return
    dkdv_cfg, dq_cfg = config

    def strides(*ts):
        return [(0, *t.stride()[:2]) for t in ts]
    if single:
        _launch_dkdv(q, k, v, dout, None, None, dk, dv, strides(q, k, v, dout, dk, dv),
                     varlen.batch, heads_q, heads_k, head_dim, total_q, total_k, varlen.max_seqlen_k,
                     total_q, sm_scale, causal, dkdv_cfg, q.dtype, False, varlen, window, scores,
                     single=_single_args(out, lse, dlse, dq, dq_cfg, varlen.batch, heads_q, varlen.max_seqlen_q,
                                         strides(out, dq)))
        return
    # The packed rows are one batch entry of total_q rows: delta, lse2 and the workspace are per row.
    dq_accum = dq_accumulator(q[None], total_q) if atomic and total_k else None
    delta, lse2 = preprocess(dout[None], out[None], lse[None], dlse[None] if dlse is not None else None,
                             total_q, q.dtype == torch.float32, dq_accum, scores.sinks, dsink)
    if total_k == 0:
        return
    if dk is not None:
        _launch_dkdv(q, k, v, dout, lse2, delta, dk, dv, strides(q, k, v, dout, dk, dv),
                     varlen.batch, heads_q, heads_k, head_dim, total_q, total_k, varlen.max_seqlen_k,
                     total_q, sm_scale, causal, dkdv_cfg, q.dtype, False, varlen, window, scores, dq_accum)
    if dq_accum is not None:
        convert_dq(dq_accum, dq[None], sm_scale)
    elif dq is not None:
        run_dq_varlen(q, k, v, dout, lse2, delta, dq, sm_scale, causal, dq_cfg, varlen, window, scores)


def run_dq_varlen(q, k, v, dout, lse2, delta, dq, sm_scale: float, causal: bool, config: BwdConfig, varlen: Varlen,
                  window=None, scores: ScoreVariant = PLAIN):
    """The Triton dQ kernel on packed sequences (``run_varlen``'s layout), with ``preprocess``'s delta
    and lse2 of the packed rows ([1, Hq, rows >= total_q]). Writes dq."""
    total_q, heads_q, head_dim = q.shape
    total_k, heads_k, _ = k.shape
    _launch_dq(q, k, v, dout, lse2, delta, dq, [(0, *t.stride()[:2]) for t in (q, k, v, dout, dq)],
               varlen.batch, heads_q, heads_k, head_dim, total_q, total_k, varlen.max_seqlen_q,
               lse2.shape[-1], sm_scale, causal, config, q.dtype, False, varlen, window, scores)
