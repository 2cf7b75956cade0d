"""FlashAttention forward: the Triton kernel and its launcher.

One program computes one block of BLOCK_M query rows of one (batch, query head):

    O[rows] = softmax(Q[rows] @ K^T * sm_scale) @ V          LSE[rows] = logsumexp(Q[rows] @ K^T * sm_scale)

It walks over K/V in blocks of BLOCK_N keys and keeps the online-softmax state in fp32 registers:
m_i (running row max), l_i (running row sum of exp(s - m_i)) and acc (running sum of exp(s - m_i) * v).
When a new block raises the max, both l_i and acc are rescaled by alpha = exp(m_old - m_new).

The exponentials are base 2: qk_scale = sm_scale * log2(e) is folded into the one FMA that also
subtracts the row max, so every exp is the hardware's exp2. The row max itself is kept in raw score
units, and the LSE written out is the natural log: m * sm_scale + ln(l).

The key range of a query block is split in two loops:

* off-band: key blocks that every row of the query block may see in full. No mask at all.
* on-band: the (at most a few) blocks that cross the causal diagonal or the end of the keys. These
  get an element mask, and rows that see no key at all are handled explicitly (out = 0, lse = -inf).

Key blocks above the diagonal are never visited. Causal masking is aligned bottom-right, as in
FlashAttention: query i sees key j when j <= i + (Sk - Sq).

Layout: every tensor is addressed as [batch, seq, heads, head_dim] through its strides (the last
stride must be 1), so FlashAttention's layout, the seeds' [B, H, S, D] layout (as a transposed view)
and q/k/v unbound from a packed qkv tensor are all read in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs, launch
from .block_ranges import (
    causal_key_range,
    causal_mask,
    sequence_bounds,
    window_kernel_args,
    window_key_range,
    window_visible,
)
from .common import (
    LOG2E,
    LOG2E_K,
    PLAIN,
    ScoreVariant,
    Varlen,
    add_sink,
    finish_rows,
    load_kv_tile,
    needs_int64_rows,
    online_softmax_step,
    score_mod,
    wide,
)
from .configs import FwdConfig
from .launch import host_descriptors, tma_compatible


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,                        # running state [BM, BD], [BM], [BM]; q tile [BM, BD]
    K, V,                                    # TMA 0: pointers to this (batch, kv head); else descriptors
    off_b, off_hk, stride_ks, stride_vs,
    offs_m, offs_d,                          # [BM] query positions, [BD] head-dim lanes
    lo, hi, seqlen_k, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PRECISE: tl.constexpr,
    window_left=0, window_right=0, HAS_LEFT: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False,
    sm_scale=None, tanh_scale=None, softcap=None, slope=None,
    SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
):
    """Fold key blocks [lo, hi) into the online-softmax state. MASKED selects the on-band version;
    HAS_LEFT / HAS_RIGHT: its mask is a local window's (common.window_visible) instead of causal's.
    SOFTCAP / ALIBI: the scores are transformed first ([Note: score variants] in common.py); m_i is
    then in natural units."""
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM                                           # [BD]
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n                                        # [BN] key positions
        # -- K^T tile [BD, BN] --
        if TMA:
            # Rows past seqlen_k and lanes past HEAD_DIM read as 0.
            k = K.load([off_b, start_n, off_hk, 0]).reshape(BLOCK_N, BLOCK_D).T
        else:
            # Read transposed through the strides: key position on the columns, head dim on the rows.
            k = load_kv_tile(K + cols[None, :] * stride_ks + offs_d[:, None], cols[None, :] < seqlen_k,
                             d_ok[:, None], MASKED, BLOCK_D != HEAD_DIM)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)               # [BM, BN] raw scores
        # m_i is the running max of the *raw* scores; the scale is applied inside the exp2's FMA.
        # (Keeping m unscaled lets the epilogue form the LSE as m * sm_scale + log(l) with one
        # rounding, as PyTorch does, instead of going through base 2 and back.)
        visible = None
        if MASKED:
            visible = cols[None, :] < seqlen_k                         # [1, BN]
            if HAS_LEFT or HAS_RIGHT:
                visible = visible & window_visible(offs_m[:, None], cols[None, :], causal_offset,
                                                   window_left, window_right, HAS_LEFT, HAS_RIGHT)  # [BM, BN]
            elif IS_CAUSAL:
                visible = visible & causal_mask(offs_m[:, None], cols[None, :], causal_offset)  # [BM, BN]
        if SOFTCAP or ALIBI:
            # Natural-unit scores (capped, biased): the exp2 then takes log2(e) as its scale.
            qk, _ = score_mod(qk, offs_m[:, None], cols[None, :], causal_offset, sm_scale, tanh_scale,
                              softcap, slope, SOFTCAP, ALIBI, q.dtype != tl.float32)   # [BM, BN]
            p, m_new, l_i, acc = online_softmax_step(qk, visible, m_i, l_i, acc, LOG2E_K, MASKED, PRECISE)
        else:
            p, m_new, l_i, acc = online_softmax_step(qk, visible, m_i, l_i, acc, qk_scale, MASKED, PRECISE)
        # -- V tile [BN, BD] --
        if TMA:
            v = V.load([off_b, start_n, off_hk, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            v = load_kv_tile(V + cols[:, None] * stride_vs + offs_d[None, :], cols[:, None] < seqlen_k,
                             d_ok[None, :], MASKED, BLOCK_D != HEAD_DIM)
        # p is in [0, 1]: cast to the input dtype for the tensor cores, accumulate in fp32.
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    num_heads_q, kv_group_size, seqlen_q, seqlen_k, num_m_blocks,
    sm_scale, qk_scale,                      # qk_scale = sm_scale * log2(e), rounded once on the host
    CU_Q, CU_K,                              # VARLEN: [B + 1] int32 first row of each sequence
    window_left, window_right,               # HAS_LEFT / HAS_RIGHT: a local window's bounds
    tanh_scale, softcap,                     # SOFTCAP: sm_scale / softcap, softcap (else None)
    ALIBI_SLOPES, stride_ab, stride_ah,      # ALIBI: [B, Hq] float32 (stride_ab 0 for [Hq]; else None)
    SINKS,                                   # HAS_SINKS: [Hq] float32 (else None)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, PRECISE: tl.constexpr,
    VARLEN: tl.constexpr = False, LONG: tl.constexpr = False,
    HAS_LEFT: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
):
    """TMA selects how tiles move: False, pointer loads/stores (any GPU, the interpreter); True, 4-D
    [B, S, H, D] tensor descriptors built on the host (Q, K, V, O are then descriptors, not
    pointers). With descriptors, rows past seqlen and lanes past HEAD_DIM read as zeros and are never
    written.

    VARLEN (variable-length batches, pointers only): q/out are [total_q, Hq, D] and k/v [total_k, Hkv,
    D] seen as one batch entry (batch strides 0); sequence b owns rows CU_Q[b] .. CU_Q[b + 1] - 1 of
    q and CU_K[b] .. CU_K[b + 1] - 1 of k/v. seqlen_q / seqlen_k come in as total_q / total_k (the
    LSE is [Hq, total_q]) and are replaced by the sequence's own lengths; num_m_blocks covers the
    longest sequence: the blocks past a shorter sequence's end return at once.

    LONG: row offsets inside a (batch, head) in int64 (``common.needs_int64_rows``).

    HAS_LEFT / HAS_RIGHT (a local, "sliding" window; IS_CAUSAL is then ignored, causal being
    window_right = 0): row i sees key j when i + off - window_left <= j <= i + off + window_right,
    off = seqlen_k - seqlen_q. The keys split in three ranges (``common.window_key_range``): masked
    blocks at the window's left edge, whole blocks every row sees, masked blocks at its right edge.

    SOFTCAP / ALIBI / HAS_SINKS: the score variants ([Note: score variants] in common.py). Their
    arguments are None (no kernel parameter) when the flag is off, so the plain kernel is unchanged."""
    tl.static_assert(not (VARLEN and TMA), "packed sequences take pointer loads")
    stride_qs, stride_ks = wide(stride_qs, LONG), wide(stride_ks, LONG)
    stride_vs, stride_os = wide(stride_vs, LONG), wide(stride_os, LONG)
    # -- which (batch, head, query block) this program owns --
    # A 1-D grid: axis 0 allows 2^31 - 1 programs, so no B*H limit applies. Query blocks of one head
    # are neighbours (they share K/V in L2). Causal blocks run heaviest (last) block first.
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    if IS_CAUSAL:
        pid_m = num_m_blocks - 1 - pid_m
    pid_bh = pid // num_m_blocks
    off_b = pid_bh // num_heads_q
    off_h = pid_bh % num_heads_q
    off_hk = off_h // kv_group_size          # GQA/MQA: the K/V head this query head reads

    # int64 base offsets: B*S*H*D easily exceeds 2^31 elements.
    q_base = off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    v_base = off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    o_base = off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    if VARLEN:
        # This sequence's rows: from here on, seqlen_q / seqlen_k are its own lengths.
        total_q = seqlen_q
        q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(CU_Q, CU_K, off_b)
        lse_base = off_h.to(tl.int64) * total_q + q_start              # LSE [Hq, total_q]
        q_base += q_start * stride_qs
        o_base += q_start * stride_os
        k_base += k_start * stride_ks
        v_base += k_start * stride_vs

    start_m = pid_m * BLOCK_M
    if VARLEN:
        if start_m >= seqlen_q:
            return                            # a block past this (shorter) sequence's end
    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BM]
    offs_d = tl.arange(0, BLOCK_D)            # [BD]
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM

    if TMA:
        q = Q.load([off_b, start_m, off_h, 0]).reshape(BLOCK_M, BLOCK_D)   # loaded once, kept
    else:
        K += k_base
        V += v_base
        q = tl.load(Q + q_base + offs_m[:, None] * stride_qs + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    slope = None
    if ALIBI:
        slope = tl.load(ALIBI_SLOPES + off_b * stride_ab + off_h * stride_ah)     # this head's (and sequence's)

    # -- key range of this query block: unmasked off-band blocks, then masked on-band blocks --
    causal_offset = seqlen_k - seqlen_q
    if HAS_LEFT or HAS_RIGHT:
        # A local window: masked left edge, whole blocks, masked right edge.
        lo, mid_lo, mid_hi, hi = window_key_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                                  BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, K, V, off_b, off_hk, stride_ks, stride_vs,
            offs_m, offs_d, lo, mid_lo, seqlen_k, causal_offset, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, TMA, DOT_PRECISION, PRECISE,
            window_left, window_right, HAS_LEFT, HAS_RIGHT,
            sm_scale=sm_scale, tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, K, V, off_b, off_hk, stride_ks, stride_vs,
            offs_m, offs_d, mid_lo, mid_hi, seqlen_k, causal_offset, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, False, IS_CAUSAL, TMA, DOT_PRECISION, PRECISE,
            sm_scale=sm_scale, tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, K, V, off_b, off_hk, stride_ks, stride_vs,
            offs_m, offs_d, mid_hi, hi, seqlen_k, causal_offset, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, TMA, DOT_PRECISION, PRECISE,
            window_left, window_right, HAS_LEFT, HAS_RIGHT,
            sm_scale=sm_scale, tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    else:
        off_band_end, hi = causal_key_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, K, V, off_b, off_hk, stride_ks, stride_vs,
            offs_m, offs_d, 0, off_band_end, seqlen_k, causal_offset, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, False, IS_CAUSAL, TMA, DOT_PRECISION, PRECISE,
            sm_scale=sm_scale, tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, K, V, off_b, off_hk, stride_ks, stride_vs,
            offs_m, offs_d, off_band_end, hi, seqlen_k, causal_offset, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, TMA, DOT_PRECISION, PRECISE,
            sm_scale=sm_scale, tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)

    # -- epilogue: normalise; a row that saw no key gets out = 0 and lse = -inf (with a sink: the sink) --
    if HAS_SINKS:
        if not (SOFTCAP or ALIBI):
            m_i = m_i * sm_scale                                     # raw score units -> natural
        acc, l_i, m_i = add_sink(acc, l_i, m_i, tl.load(SINKS + off_h))
        out, lse = finish_rows(acc, l_i, m_i, 1.0)
    elif SOFTCAP or ALIBI:
        out, lse = finish_rows(acc, l_i, m_i, 1.0)                   # m_i is in natural units
    else:
        out, lse = finish_rows(acc, l_i, m_i, sm_scale)
    if VARLEN:
        lse_ptrs = LSE + lse_base + offs_m
    else:
        lse_ptrs = LSE + pid_bh.to(tl.int64) * seqlen_q + offs_m          # LSE [B, Hq, Sq]
    tl.store(lse_ptrs, lse, mask=m_ok)
    if TMA:
        O.store([off_b, start_m, off_h, 0], out.to(O.dtype).reshape(1, BLOCK_M, 1, BLOCK_D))
    else:
        o_ptrs = O + o_base + offs_m[:, None] * stride_os + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------

def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, sm_scale: float, causal: bool,
        config: FwdConfig, window: tuple[int, int] | None = None, scores: ScoreVariant = PLAIN):
    """The Triton forward on [B, S, H, D] views (last stride 1) with at least one query and one key
    (``dispatch.forward`` chooses the kernel and config and handles empty inputs). Writes ``out``;
    returns (out, lse [B, Hq, Sq] float32 natural log). ``window``: ``window_bounds``' form."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_k, _ = k.shape
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    tma = config.tma == "host" and tma_compatible(q, k, v, out)
    block_d = configs.head_dim_block(head_dim)
    Q, K, V, O = q, k, v, out
    if tma:
        Q, O = host_descriptors(config.block_m, block_d, q, out)
        K, V = host_descriptors(config.block_n, block_d, k, v)
    _launch(Q, K, V, O, lse, q.stride()[:3], k.stride()[:3], v.stride()[:3], out.stride()[:3],
            batch, heads_q, heads_k, head_dim, seqlen_q, seqlen_k, seqlen_q, sm_scale, causal, config,
            q.dtype, tma, window=window, scores=scores)
    return out, lse


def _launch(Q, K, V, O, lse, q_strides, k_strides, v_strides, o_strides, batch, heads_q, heads_k,
            head_dim, seqlen_q, seqlen_k, max_seqlen_q, sm_scale, causal, config, dtype, tma, varlen=None,
            window=None, scores: ScoreVariant = PLAIN):
    """One launch of ``_attn_fwd_kernel``: a program per (batch, query head, query block of the
    longest sequence)."""
    num_m_blocks = configs.cdiv(max_seqlen_q, config.block_m)
    grid = (num_m_blocks * batch * heads_q,)
    launch.run(
        _attn_fwd_kernel, grid,
        Q=Q, K=K, V=V, O=O, LSE=lse,
        stride_qb=q_strides[0], stride_qs=q_strides[1], stride_qh=q_strides[2],
        stride_kb=k_strides[0], stride_ks=k_strides[1], stride_kh=k_strides[2],
        stride_vb=v_strides[0], stride_vs=v_strides[1], stride_vh=v_strides[2],
        stride_ob=o_strides[0], stride_os=o_strides[1], stride_oh=o_strides[2],
        num_heads_q=heads_q, kv_group_size=heads_q // heads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        num_m_blocks=num_m_blocks, sm_scale=sm_scale, qk_scale=sm_scale * LOG2E,
        CU_Q=varlen.cu_seqlens_q if varlen is not None else None,
        CU_K=varlen.cu_seqlens_k if varlen is not None else None,
        **window_kernel_args(window), **scores.transform_kwargs(sm_scale), **scores.sink_kwargs(),
        HEAD_DIM=head_dim, BLOCK_D=configs.head_dim_block(head_dim),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        IS_CAUSAL=causal, TMA=tma,
        # fp32 inputs: full IEEE fp32 products (Triton's default would be tf32, ~1e-3 relative error).
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        # fp32: the softmax's largest score gets p = 1 exactly (see online_softmax_step).
        PRECISE=dtype == torch.float32,
        VARLEN=varlen is not None, LONG=needs_int64_rows(Q, K, V, O),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def run_varlen(q, k, v, out, sm_scale, causal, config: FwdConfig, varlen: Varlen, window=None,
               scores: ScoreVariant = PLAIN):
    """The Triton forward on packed sequences (see ``Varlen``): q / out [total_q, Hq, D], k / v
    [total_k, Hkv, D]; returns (out, lse [Hq, total_q]). Pointer loads: a tile descriptor would
    read across a sequence's end. Handles empty inputs itself."""
    total_q, heads_q, head_dim = q.shape
    total_k, heads_k, _ = k.shape
    lse = torch.empty((heads_q, total_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if total_k == 0:
        scores.fill_no_keys(out, lse)  # no key in any sequence: every row is empty
        return out, lse
    # Batch strides 0: the sequence's first row comes from cu_seqlens.
    _launch(q, k, v, out, lse, (0, *q.stride()[:2]), (0, *k.stride()[:2]), (0, *v.stride()[:2]),
            (0, *out.stride()[:2]), varlen.batch, heads_q, heads_k, head_dim, total_q, total_k,
            varlen.max_seqlen_q, sm_scale, causal, config, q.dtype, False, varlen, window, scores)
    return out, lse
