"""Decode attention over a KV cache (contiguous or paged), split-KV ("flash-decoding").

One program computes, for one (batch b, KV head hk, M block, split s), the attention of the packed
query tile against one contiguous range of sequence b's keys:

    rows  r = i * GROUP + g              query position i < Sq, query head hk * GROUP + g (GQA packing)
    keys  [lo_s, hi_s) of 0 .. L_b - 1   L_b = cache_seqlens[b] (+ the appended keys)

Packing the GROUP query heads that share a KV head (times the Sq query positions) into the M dimension
of one tile means every K/V tile is read from memory once for the whole group, and tl.dot gets an M
of at least 16 (padded rows hold zero queries and are never stored). Decode is bound by reading K and
V, so the loop is a plain stream over key blocks: BLOCK_N keys per step, each key's head_dim row
loaded as contiguous 16-byte vectors, and num_stages-deep software pipelining of those loads.

Split-KV: a sequence's key blocks are cut into num_splits contiguous ranges of equal size (in whole
BLOCK_N blocks), one per program, so that a batch of one long sequence still fills the GPU. Each split
writes a partial (out in fp32, lse) to a workspace laid out exactly like ``merge_attn_states``'
input ([N, B, Sq, Hq, D] and [N, B, Hq, Sq]) and the merge kernel (merge.py) combines them. A split
that gets no key (a short sequence, or a length of 0) writes out = 0, lse = -inf, which the merge
ignores. With num_splits = 1 the program writes the final out (in q's dtype) and lse directly.

Key ranges: with causal masking (bottom-right: query i sees key j when j <= i + L_b - Sq) only the last
Sq - 1 keys of a sequence are hidden from some rows. So each split runs an unmasked loop over the
key blocks every row sees in full, then a masked loop over the rest of its range (the tail block
and the causal band), which also masks keys past the split's end. Rows that see no key at all get
out = 0 and lse = -inf (never NaN).

Paged caches: a cache of [num_pages, PAGE_SIZE, Hkv, D] and block_table [B, max_pages]: key j of
sequence b lives at page block_table[b, j // PAGE_SIZE], slot j % PAGE_SIZE: one table read per key
block when pages hold whole blocks, one per key otherwise (any page size works). The math is the
forward kernel's (forward.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import configs, launch
from .block_ranges import (
    causal_mask,
    split_key_range,
    split_program,
    split_window_range,
    window_kernel_args,
    window_visible,
)
from .common import (
    LOG2E,
    LOG2E_K,
    PLAIN,
    ScoreVariant,
    accumulate_pv,
    add_sink,
    finish_rows,
    load_kv_tile,
    needs_int64_rows,
    online_softmax_step,
    partial_and_table_strides,
    score_dot,
    score_mod,
    wide,
)
from .configs import DecodeConfig


@triton.jit
def _key_offsets(BT, k_base, v_base, start_n, offs_n, valid, hi,
                 stride_kp, stride_ks, stride_vp, stride_vs, stride_btp,
                 PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 PER_PAGE: tl.constexpr):
    """Element offsets [BN] (int64) of the first head-dim lane of keys start_n + offs_n in K and V.

    BT points at this sequence's block-table row; k_base / v_base include the KV head (and, for a
    contiguous cache, the batch). ``valid`` masks the block-table reads of keys past the range."""
    cols = start_n + offs_n                                            # [BN] key positions
    if PAGED:
        if PAGE_SIZE % BLOCK_N == 0:
            # The whole block is in one page (blocks start at multiples of BLOCK_N).
            page = tl.load(BT + (start_n // PAGE_SIZE) * stride_btp).to(tl.int64)   # scalar
            slot = (start_n % PAGE_SIZE) + offs_n                      # [BN]
            k_off = k_base + page * stride_kp + slot * stride_ks
            v_off = v_base + page * stride_vp + slot * stride_vs
        elif PER_PAGE:
            # BLOCK_N // PAGE_SIZE whole pages: one block-table read per page, not per key.
            PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
            offs_p = start_n // PAGE_SIZE + tl.arange(0, PAGES)        # [P] block-table index
            page = tl.load(BT + offs_p * stride_btp, mask=offs_p * PAGE_SIZE < hi,
                           other=0).to(tl.int64)                      # [P]
            slot = tl.arange(0, PAGE_SIZE)                             # [PS]
            k_off = k_base + tl.reshape(page[:, None] * stride_kp + slot[None, :] * stride_ks,
                                        [BLOCK_N])
            v_off = v_base + tl.reshape(page[:, None] * stride_vp + slot[None, :] * stride_vs,
                                        [BLOCK_N])
            # The reshape hides the strides' divisibility from Triton's alignment analysis.
            k_off = tl.multiple_of(k_off, 8)
            v_off = tl.multiple_of(v_off, 8)
        else:
            page = tl.load(BT + (cols // PAGE_SIZE) * stride_btp, mask=valid, other=0)     # [BN]
            page = page.to(tl.int64)
            slot = cols % PAGE_SIZE                                    # [BN]
            k_off = k_base + page * stride_kp + slot * stride_ks
            v_off = v_base + page * stride_vp + slot * stride_vs
    else:
        cols64 = cols.to(tl.int64)
        k_off = k_base + cols64 * stride_ks
        v_off = v_base + cols64 * stride_vs
    return k_off, v_off


@triton.jit
def _decode_inner(
    acc, l_i, m_i, q,                        # running state [BM, BD], [BM], [BM]; q tile [BM, BD]
    K, V, BT, k_base, v_base,
    stride_kp, stride_ks, stride_vp, stride_vs, stride_btp,
    offs_i, offs_d,                          # [BM] query position of each row, [BD] head-dim lanes
    lo, hi, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, PER_PAGE: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PRECISE: tl.constexpr, NUM_STAGES: tl.constexpr,
    window_left=0, window_right=0, HAS_LEFT: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False,
    sm_scale=None, tanh_scale=None, softcap=None, slope=None,
    SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
):
    """Fold key blocks [lo, hi) into the online-softmax state. MASKED: keys at or past ``hi`` and
    (causal) keys after a row's diagonal are hidden, or with HAS_LEFT / HAS_RIGHT the keys outside
    a row's local window; otherwise every key of every block is seen. SOFTCAP / ALIBI as in the
    forward kernel (slope: [BM, 1], each row's head's)."""
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM                                           # [BD]
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n                                        # [BN]
        n_ok = cols < hi                                               # [BN]
        k_off, v_off = _key_offsets(BT, k_base, v_base, start_n, offs_n, n_ok, hi,
                                    stride_kp, stride_ks, stride_vp, stride_vs, stride_btp,
                                    PAGED, PAGE_SIZE, BLOCK_N, PER_PAGE)
        # -- K^T tile [BD, BN]: key on the columns, head dim (contiguous) on the rows --
        k = load_kv_tile(K + k_off[None, :] + offs_d[:, None], n_ok[None, :], d_ok[:, None],
                         MASKED, BLOCK_D != HEAD_DIM)
        qk = score_dot(q, k, DOT_PRECISION, PRECISE)                   # [BM, BN] raw scores
        visible = None
        if MASKED:
            visible = n_ok[None, :]                                    # [1, BN]
            if HAS_LEFT or HAS_RIGHT:
                visible = visible & window_visible(offs_i[:, None], cols[None, :], causal_offset,
                                                   window_left, window_right, HAS_LEFT, HAS_RIGHT)
            elif IS_CAUSAL:
                visible = visible & causal_mask(offs_i[:, None], cols[None, :], causal_offset)   # [BM, BN]
        if SOFTCAP or ALIBI:
            qk, _ = score_mod(qk, offs_i[:, None], cols[None, :], causal_offset, sm_scale, tanh_scale, softcap,
                              slope, SOFTCAP, ALIBI, q.dtype != tl.float32)   # natural units
            p, m_new, l_i, acc = online_softmax_step(qk, visible, m_i, l_i, acc, LOG2E_K, MASKED, PRECISE)
        else:
            p, m_new, l_i, acc = online_softmax_step(qk, visible, m_i, l_i, acc, qk_scale, MASKED, PRECISE)
        # -- V tile [BN, BD] --
        v = load_kv_tile(V + v_off[:, None] + offs_d[None, :], n_ok[:, None], d_ok[None, :],
                         MASKED, BLOCK_D != HEAD_DIM)
        acc = accumulate_pv(acc, p.to(v.dtype), v, DOT_PRECISION, PRECISE)
        m_i = m_new
    return acc, l_i, m_i


# Lengths and counts that change from one decode step to the next are not specialised (== 1, % 16):
# a generation loop would otherwise recompile as its lengths and split counts grow.
@triton.jit(do_not_specialize=["seqlen_k", "seqlen_new", "num_m_blocks", "num_splits"])
def _decode_kernel(
    Q, K, V, O, LSE, SEQLENS, BLOCK_TABLE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,         # paged: page, slot, head; contiguous: batch, seq, head
    stride_vb, stride_vs, stride_vh,
    stride_on, stride_ob, stride_os, stride_oh,  # O [N, B, Sq, Hq, D] (split stride 0 when N = 1)
    stride_ln, stride_lb, stride_lh,         # LSE [N, B, Hq, Sq], unit stride on Sq
    stride_sl, stride_btb, stride_btp,
    heads_kv, seqlen_q, seqlen_k, seqlen_new, num_m_blocks, num_splits,
    sm_scale, qk_scale,                      # qk_scale = sm_scale * log2(e), rounded once on the host
    window_left, window_right,               # HAS_LEFT / HAS_RIGHT: a local window's bounds
    tanh_scale, softcap,                     # SOFTCAP: sm_scale / softcap, softcap (else None)
    ALIBI_SLOPES, stride_ab, stride_ah,      # ALIBI: [B, Hq] float32 (stride_ab 0 for [Hq]; else None)
    SINKS,                                   # HAS_SINKS: [Hq] float32 (else None)
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, PER_PAGE: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, PRECISE: tl.constexpr,
    NUM_STAGES: tl.constexpr, LONG: tl.constexpr = False,
    HAS_LEFT: tl.constexpr = False, HAS_RIGHT: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
):
    """SEQLENS: cache_seqlens [B] (the keys attended are cache_seqlens[b] + seqlen_new); without it
    every sequence has seqlen_k keys. BLOCK_TABLE: [B, max_pages] int32 when PAGED. LONG: q's and
    out's row offsets in int64 (``common.needs_int64_rows``; the cache's are always). HAS_LEFT /
    HAS_RIGHT: a local window (``split_window_range``; IS_CAUSAL is then its right bound of 0).
    SOFTCAP / ALIBI / HAS_SINKS: the score variants ([Note: score variants] in common.py), ALiBi per
    sequence (its own length). HAS_SINKS only with one split: with several, the merge adds the sink
    once (``merge.merge``'s ``sinks``)."""
    stride_qs, stride_os, stride_lh = wide(stride_qs, LONG), wide(stride_os, LONG), wide(stride_lh, LONG)
    # -- which (batch, kv head, split, M block) this program owns --
    pid_m, split, off_hk, off_b, seqlen = split_program(
        SEQLENS, stride_sl, heads_kv, seqlen_k, seqlen_new, num_m_blocks, num_splits, HAS_SEQLENS)

    # -- the packed query tile: row r is query position r // GROUP of head off_hk * GROUP + r % GROUP --
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                   # [BM]
    offs_i = offs_r // GROUP                                           # [BM] query position
    offs_g = offs_r % GROUP                                            # [BM] head within the group
    offs_d = tl.arange(0, BLOCK_D)                                     # [BD]
    r_ok = offs_r < GROUP * seqlen_q
    d_ok = offs_d < HEAD_DIM
    head0 = off_hk * GROUP
    # int64 base offsets: caches of many pages exceed 2^31 elements.
    q_base = off_b.to(tl.int64) * stride_qb + head0.to(tl.int64) * stride_qh
    q = tl.load(Q + q_base + offs_i[:, None] * stride_qs + offs_g[:, None] * stride_qh
                + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)   # [BM, BD]

    k_base = off_hk.to(tl.int64) * stride_kh
    v_base = off_hk.to(tl.int64) * stride_vh
    if PAGED:
        BT = BLOCK_TABLE + off_b.to(tl.int64) * stride_btb
    else:
        BT = BLOCK_TABLE
        k_base += off_b.to(tl.int64) * stride_kb
        v_base += off_b.to(tl.int64) * stride_vb

    if HAS_LEFT or HAS_RIGHT:
        lo, hi, causal_offset = split_window_range(seqlen, split, num_splits, seqlen_q, window_left,
                                               window_right, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    else:
        lo, mid, hi, causal_offset = split_key_range(seqlen, split, num_splits, seqlen_q, BLOCK_N, IS_CAUSAL)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    slope = None
    if ALIBI:
        slope = tl.load(ALIBI_SLOPES + off_b * stride_ab + (head0 + offs_g) * stride_ah)[:, None]   # [BM, 1]
    if HAS_LEFT or HAS_RIGHT:
        acc, l_i, m_i = _decode_inner(
            acc, l_i, m_i, q, K, V, BT, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs,
            stride_btp, offs_i, offs_d, lo, hi, causal_offset, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGED, PAGE_SIZE, PER_PAGE, True, IS_CAUSAL, DOT_PRECISION,
            PRECISE, NUM_STAGES, window_left, window_right, HAS_LEFT, HAS_RIGHT,
            sm_scale=sm_scale, tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    else:
        acc, l_i, m_i = _decode_inner(
            acc, l_i, m_i, q, K, V, BT, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs,
            stride_btp, offs_i, offs_d, lo, mid, causal_offset, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGED, PAGE_SIZE, PER_PAGE, False, IS_CAUSAL, DOT_PRECISION,
            PRECISE, NUM_STAGES,
            sm_scale=sm_scale, tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
        acc, l_i, m_i = _decode_inner(
            acc, l_i, m_i, q, K, V, BT, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs,
            stride_btp, offs_i, offs_d, mid, hi, causal_offset, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGED, PAGE_SIZE, PER_PAGE, True, IS_CAUSAL, DOT_PRECISION,
            PRECISE, 1,
            sm_scale=sm_scale, tanh_scale=tanh_scale, softcap=softcap, slope=slope, SOFTCAP=SOFTCAP, ALIBI=ALIBI)

    # -- epilogue: normalise; no visible key (empty split, L = 0, causal rows) -> out 0, lse -inf --
    # fp32 split-KV partials keep their LSE in float64 (the launcher says why).
    if HAS_SINKS:
        if not (SOFTCAP or ALIBI):
            m_i = m_i * sm_scale                                       # raw score units -> natural
        acc, l_i, m_i = add_sink(acc, l_i, m_i, tl.load(SINKS + head0 + offs_g))   # each row's head's
        out, lse = finish_rows(acc, l_i, m_i, 1.0, LSE.dtype.element_ty == tl.float64, PRECISE)
    elif SOFTCAP or ALIBI:
        out, lse = finish_rows(acc, l_i, m_i, 1.0, LSE.dtype.element_ty == tl.float64, PRECISE)
    else:
        out, lse = finish_rows(acc, l_i, m_i, sm_scale, LSE.dtype.element_ty == tl.float64, PRECISE)
    heads = head0 + offs_g                                             # [BM] query head of each row
    o_base = split.to(tl.int64) * stride_on + off_b.to(tl.int64) * stride_ob
    o_ptrs = O + o_base + offs_i[:, None] * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    l_base = split.to(tl.int64) * stride_ln + off_b.to(tl.int64) * stride_lb
    tl.store(LSE + l_base + heads * stride_lh + offs_i, lse, mask=r_ok)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------

def partials(q: torch.Tensor, splits: int):
    """Split-KV partial results in merge_attn_states' layout, carved from one allocation (each
    allocation is host time in every decode step): o_part [N, B, Sq, Hq, D] float32 and l_part
    [N, B, Hq, Sq]. fp32 inputs get float64 partial LSEs, so a merge weight exp(lse_split - lse_max)
    carries no fp32 rounding of an LSE (~1e-6 at |lse| ~ 10); fp16/bf16 outputs are far coarser."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    l_dtype = torch.float64 if q.dtype == torch.float32 else torch.float32
    o_shape, l_shape = (splits, batch, seqlen_q, heads_q, head_dim), (splits, batch, heads_q, seqlen_q)
    o_bytes = 4 * math.prod(o_shape)
    l_start = configs.cdiv(o_bytes, 256) * 256
    work = torch.empty(l_start + l_dtype.itemsize * math.prod(l_shape), dtype=torch.uint8, device=q.device)
    return work[:o_bytes].view(torch.float32).view(o_shape), work[l_start:].view(l_dtype).view(l_shape)


def run(q, k_cache, v_cache, o_part, l_part, cache_seqlens, block_table, seqlen_new, sm_scale, causal,
        config: DecodeConfig, window=None, scores: ScoreVariant = PLAIN):
    """The Triton decode kernel on prepared partials (o_part / l_part: the final out
    and lse with a leading axis when config.num_splits is 1). ``scores``: the score variants; a
    sink is added here only with one split (the merge adds it otherwise)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    group = heads_q // heads_kv
    splits = config.num_splits
    num_m_blocks = configs.cdiv(group * seqlen_q, config.block_m)
    paged = block_table is not None
    has_seqlens = cache_seqlens is not None
    # Unused pointer arguments get a valid tensor of the right kind (never dereferenced).
    seqlens_arg = cache_seqlens if has_seqlens else l_part
    table_arg = block_table if paged else l_part
    page_size = k_cache.shape[1] if paged else 1
    # Per-page block-table reads (see _key_offsets) when whole pages tile a key block and every
    # K/V offset is a multiple of 8 elements (the kernel asserts that alignment to the compiler).
    per_page = (paged and page_size < config.block_n
                and config.block_n % page_size == 0
                and all(s % 8 == 0 for s in k_cache.stride()[:3] + v_cache.stride()[:3]))
    grid = (batch * heads_kv * splits * num_m_blocks,)
    launch.run(
        _decode_kernel, grid,
        Q=q, K=k_cache, V=v_cache, O=o_part, LSE=l_part, SEQLENS=seqlens_arg, BLOCK_TABLE=table_arg,
        stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2),
        stride_kb=k_cache.stride(0), stride_ks=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0), stride_vs=v_cache.stride(1), stride_vh=v_cache.stride(2),
        **partial_and_table_strides(o_part, l_part, cache_seqlens, block_table),
        heads_kv=heads_kv, seqlen_q=seqlen_q, seqlen_k=k_cache.shape[1], seqlen_new=seqlen_new,
        num_m_blocks=num_m_blocks, num_splits=splits, sm_scale=sm_scale, qk_scale=sm_scale * LOG2E,
        **window_kernel_args(window), **scores.transform_kwargs(sm_scale),
        **scores.sink_kwargs(in_kernel=splits == 1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=configs.head_dim_block(head_dim),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        PAGED=paged, PAGE_SIZE=page_size, PER_PAGE=per_page, HAS_SEQLENS=has_seqlens,
        IS_CAUSAL=causal,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # fp32: the forward's precise form (p = 1 for a row's largest score, p @ v summed block by
        # block, an IEEE division at the end).
        PRECISE=q.dtype == torch.float32,
        NUM_STAGES=config.num_stages, LONG=needs_int64_rows(q, o_part),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
