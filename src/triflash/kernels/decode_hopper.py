"""Decode attention over a KV cache for Hopper (sm_90) in Gluon: a TMA-fed K/V ring and wgmma.

Same contract as the Triton decode kernel (decode.py): one program per (batch, KV head, split, M
block) attends the packed query tile (the GROUP query heads of a KV head times the Sq positions) to
one range of the sequence's keys, and writes the final (out, lse) or a split's partial for the merge.

Decode streams K/V bytes, so speed is how many bytes are in flight and how little else happens per
byte. Here a **producer** warp reads the block table and issues one TMA box per page (``BOX`` = min(page
size, BLOCK_N) keys, 64 head-dim columns) into a ring of ``STAGES`` slots, computing no per-key address;
a **consumer** warpgroup computes S = Q K^T and O += P V with wgmma (the query tile padded to 64 rows,
the wgmma M) and the online softmax in registers (``sm90_common.softmax``). Design and measurements:
docs/hopper.md#decode-kernel.

The key ranges come from block_ranges (``split_program``, ``split_key_range``), as in the Triton
kernel. TMA copies whole boxes, so a masked block also brings keys past the range's end: their scores
are -inf, and the consumer zeroes those rows of the V tile before P V (0 * NaN is NaN on the tensor
cores, and a cache from torch.empty may hold NaN there). Pages past a sequence's end are never looked
up; their boxes read page 0, whose keys are all masked.

Local windows take the key range of ``split_window_range`` (as the Triton kernel), walked masked,
each row between its window's edges. The score variants ([Note: score variants] in common.py) go
through ``sm90_common.Scores`` as in the forward, with one ALiBi slope per row (a tile's rows belong
to GROUP query heads); a sink is folded into the epilogue with one split, by the merge with several.

Supported: fp16/bf16, head_dim 64 or 128, TMA-compatible caches (``supported``), contiguous or paged
with a power-of-two page size of at least 8. Everything else takes the Triton kernel.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import launch
from .block_ranges import causal_col_limit, split_key_range, split_program, split_window_range, window_kernel_args
from .common import PLAIN, ScoreVariant, needs_int64_rows, on_input_device, partial_and_table_strides, rows_past_int32
from .configs import GLUON_DECODE_ROWS, cdiv, gluon_hopper_applies
from .launch import tma_compatible
from .sm90_common import (
    SCALAR,
    Ring,
    ScoreArgs,
    Window,
    aggregate,
    constexprs,
    descriptor,
    finish_rows,
    fold_sink,
    natural_units,
    score_launch_args,
    softmax,
    to_operand,
    zero_tail,
)

ROWS = gl.constexpr(GLUON_DECODE_ROWS)   # query rows per program: the wgmma M of one warpgroup
HALF = gl.constexpr(64)      # head-dim columns per shared-memory tile (128-byte rows at 16 bits)
MIN_BOX = 8          # rows of one 128-byte swizzle atom: the smallest page a box may hold
# setmaxnreg of the producer's warpgroup: more than the forward's and the backward's
# (sm90_common.PRODUCER_REGS): it reads the block table and issues a TMA box per page (docs/hopper.md).
DECODE_PRODUCER_REGS = 48
SHARED_PER_SM = 232448   # bytes of shared memory the CTAs of one H100/H200 SM may use together


@aggregate
class DecConfig:
    """The compile-time configuration of a launch and the consumer warpgroup's register layouts: S
    [ROWS, BLOCK_N] and O [ROWS, HALF] wgmma accumulators (four warps on the rows), P as the A operand
    of P V, a blocked layout for loading the query tile and zeroing V rows."""
    GROUP: gl.constexpr
    BLOCK_N: gl.constexpr
    BOX: gl.constexpr
    PAGE_SIZE: gl.constexpr
    PAGED: gl.constexpr
    HAS_SEQLENS: gl.constexpr
    IS_CAUSAL: gl.constexpr
    STAGES: gl.constexpr
    HALVES: gl.constexpr
    s_layout: gl.constexpr
    o_layout: gl.constexpr
    p_layout: gl.constexpr
    ld_layout: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, GROUP, BLOCK_N, BOX, PAGE_SIZE, PAGED, HAS_SEQLENS, IS_CAUSAL, STAGES, HALVES):
        constexprs(self, GROUP=GROUP, BLOCK_N=BLOCK_N, BOX=BOX, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED,
                   HAS_SEQLENS=HAS_SEQLENS, IS_CAUSAL=IS_CAUSAL, STAGES=STAGES, HALVES=HALVES)
        s = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF.value, 16])
        constexprs(self, s_layout=s, o_layout=o, p_layout=gl.DotOperandLayout(operand_index=0, parent=o, k_width=2),
                   ld_layout=gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


@aggregate
class DecWork:
    """How the launch cuts the work (``block_ranges.split_program``, ``split_key_range``, or with a
    local window ``split_window_range``): both partitions derive their program's keys from these, so
    they walk the same blocks."""
    SEQLENS: gl.tensor
    stride_sl: SCALAR
    heads_kv: SCALAR
    seqlen_q: SCALAR
    seqlen_k: SCALAR
    seqlen_new: SCALAR
    num_m_blocks: SCALAR
    num_splits: SCALAR
    window: Window

    @gluon.constexpr_function
    def __init__(self, SEQLENS, stride_sl, heads_kv, seqlen_q, seqlen_k, seqlen_new, num_m_blocks, num_splits,
                 window):
        self.window = window
        constexprs(self, SEQLENS=SEQLENS, stride_sl=stride_sl, heads_kv=heads_kv, seqlen_q=seqlen_q,
                   seqlen_k=seqlen_k, seqlen_new=seqlen_new, num_m_blocks=num_m_blocks, num_splits=num_splits)

    @gluon.jit
    def program(self, cfg):
        """(pid_m, split, off_hk, off_b, lo, mid, hi, causal_offset) of this program: keys [lo, mid)
        unmasked, [mid, hi) masked (with a window all of them: mid = lo)."""
        pid_m, split, off_hk, off_b, seqlen = split_program(
            self.SEQLENS, self.stride_sl, self.heads_kv, self.seqlen_k, self.seqlen_new, self.num_m_blocks,
            self.num_splits, cfg.HAS_SEQLENS)
        if self.window.ON:
            lo, hi, causal_offset = split_window_range(seqlen, split, self.num_splits, self.seqlen_q,
                                                       self.window.left, self.window.right, cfg.BLOCK_N,
                                                       self.window.HAS_LEFT, self.window.HAS_RIGHT)
            mid = lo
        else:
            lo, mid, hi, causal_offset = split_key_range(seqlen, split, self.num_splits, self.seqlen_q,
                                                         cfg.BLOCK_N, cfg.IS_CAUSAL)
        return pid_m, split, off_hk, off_b, lo, mid, hi, causal_offset


@aggregate
class DecCache:
    """The producer's inputs: the K and V caches through TMA descriptors, and the block table."""
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    BLOCK_TABLE: gl.tensor
    stride_btb: SCALAR
    stride_btp: SCALAR

    @gluon.constexpr_function
    def __init__(self, k_desc, v_desc, BLOCK_TABLE, stride_btb, stride_btp):
        constexprs(self, k_desc=k_desc, v_desc=v_desc, BLOCK_TABLE=BLOCK_TABLE, stride_btb=stride_btb,
                   stride_btp=stride_btp)


@aggregate
class DecIO:
    """The consumer's inputs and outputs: Q, and out / lse (a split's partials when num_splits > 1)
    by pointer and strides, the softmax scales (``sm_scale`` the epilogue's: 1 when softcap puts the
    scores in natural units) and the score variants (``ScoreArgs``)."""
    Q: gl.tensor
    O: gl.tensor
    LSE: gl.tensor
    stride_qb: SCALAR
    stride_qs: SCALAR
    stride_qh: SCALAR
    stride_on: SCALAR
    stride_ob: SCALAR
    stride_os: SCALAR
    stride_oh: SCALAR
    stride_ln: SCALAR
    stride_lb: SCALAR
    stride_lh: SCALAR
    sm_scale: SCALAR
    qk_scale: gl.tensor
    scores: ScoreArgs

    @gluon.constexpr_function
    def __init__(self, Q, O, LSE, stride_qb, stride_qs, stride_qh, stride_on, stride_ob, stride_os, stride_oh,
                 stride_ln, stride_lb, stride_lh, sm_scale, qk_scale, scores):
        self.scores = scores
        constexprs(self, Q=Q, O=O, LSE=LSE, stride_qb=stride_qb, stride_qs=stride_qs, stride_qh=stride_qh,
                   stride_on=stride_on, stride_ob=stride_ob, stride_os=stride_os, stride_oh=stride_oh,
                   stride_ln=stride_ln, stride_lb=stride_lb, stride_lh=stride_lh, sm_scale=sm_scale, qk_scale=qk_scale)


@gluon.jit
def _page_ids(table, start, hi, stride_btp, offs_p, BOX: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """Block-table entries of the boxes of the key block at ``start`` ([PAGES]); boxes at or past
    ``hi`` get page 0 without a table read."""
    key0 = start + offs_p * BOX
    return gl.load(table + (key0 // PAGE_SIZE) * stride_btp, mask=key0 < hi, other=0)


@gluon.jit
def _producer(cfg, work, cache, k, v):
    """One warp: for each key block of [lo, hi), wait for its ring slot (``k`` and ``v``: one slot
    number, separate barriers), then one TMA box per page (BOX keys) and per 64 head-dim columns, for
    K and for V."""
    pid_m, split, off_hk, off_b, lo, mid, hi, causal_offset = work.program(cfg)
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    BOX: gl.constexpr = cfg.BOX
    HALVES: gl.constexpr = cfg.HALVES
    PAGES: gl.constexpr = BLOCK_N // BOX
    NBYTES: gl.constexpr = BLOCK_N * HALVES * cache.k_desc.block_type.nbytes // BOX
    p_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs_p = gl.arange(0, PAGES, layout=p_layout)
    table = cache.BLOCK_TABLE + off_b.to(gl.int64) * cache.stride_btb
    n = gl.maximum(hi - lo + BLOCK_N - 1, 0) // BLOCK_N
    if cfg.PAGED:
        ids = _page_ids(table, lo, hi, cache.stride_btp, offs_p, BOX, cfg.PAGE_SIZE)
    for j in range(n):
        start = lo + j * BLOCK_N
        s = k.index(j)
        phase = k.phase(j) ^ 1                          # a fresh barrier passes parity 1 at once
        k.acquire_at(s, phase)
        v.acquire_at(s, phase)
        mbarrier.expect(k.ready.index(s), NBYTES)
        mbarrier.expect(v.ready.index(s), NBYTES)
        for p in gl.static_range(PAGES):
            if cfg.PAGED:
                page = gl.sum(gl.where(offs_p == p, ids, 0), axis=0)
                slot = (start + p * BOX) % cfg.PAGE_SIZE
            else:
                page = off_b
                slot = start + p * BOX
            for h in gl.static_range(HALVES):
                tma.async_copy_global_to_shared(cache.k_desc, [page, slot, off_hk, h * HALF], k.ready.index(s),
                                                k.mem.index(s * HALVES + h).slice(p * BOX, BOX))
                tma.async_copy_global_to_shared(cache.v_desc, [page, slot, off_hk, h * HALF], v.ready.index(s),
                                                v.mem.index(s * HALVES + h).slice(p * BOX, BOX))
        if cfg.PAGED:
            # The next block's entries: their latency passes while this warp waits for a free slot.
            ids = _page_ids(table, start + BLOCK_N, hi, cache.stride_btp, offs_p, BOX, cfg.PAGE_SIZE)


@gluon.jit
def _zero_tail(v_smem, first, start, hi, HALVES: gl.constexpr, BLOCK_N: gl.constexpr,
               ld_layout: gl.constexpr):
    """Zero the rows of a landed V block whose keys are at or past ``hi`` (P is 0 there, but the
    bytes may be NaN), and make the writes visible to wgmma's reads."""
    for h in gl.static_range(HALVES):
        zero_tail(v_smem.index(first + h), start, hi, BLOCK_N, BLOCK_N, ld_layout)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _consume(cfg, q_smem, k, v, c, lo, hi, acc0, acc1, m_i, l_i, s_zero, mod, col_limit, col_start, qk_scale,
             MASKED: gl.constexpr):
    """Fold key blocks [lo, hi) into (acc0, acc1, m, l); ``c`` counts blocks (ring slot and phase).
    ``mod``: the score variants (``Scores``; a no-op without). MASKED: scores at columns >= col_limit
    (per row), and with ``col_start`` (a window's left edge) below it, are -inf, and V rows past
    ``hi`` are zeroed."""
    dtype: gl.constexpr = q_smem.dtype
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    HALVES: gl.constexpr = cfg.HALVES
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, cfg.s_layout))
    for start in range(lo, hi, BLOCK_N):
        s = k.index(c)
        phase = k.phase(c)
        k.wait_at(s, phase)
        tok = warpgroup_mma(q_smem.index(0), k.tile(s * HALVES).permute((1, 0)), s_zero,
                            use_acc=False, is_async=True)
        if HALVES == 2:
            tok = warpgroup_mma(q_smem.index(1), k.tile(s * HALVES + 1).permute((1, 0)), tok,
                                is_async=True)
        sc = warpgroup_mma_wait(0, deps=(tok,))
        k.release(s)
        sc = mod.apply(sc, start + cols0)
        p, m_i, l_i, alpha = softmax(sc, m_i, l_i, col_limit, start + cols0, qk_scale, MASKED, col_start=col_start)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, cfg.o_layout))[:, None]
        p_op = to_operand(p, dtype, cfg.p_layout)
        v.wait_at(s, phase)
        if MASKED:
            if start + BLOCK_N > hi:
                _zero_tail(v.mem, s * HALVES, start, hi, HALVES, BLOCK_N, cfg.ld_layout)
        tok0 = warpgroup_mma(p_op, v.tile(s * HALVES), acc0 * alpha_o, is_async=True)
        if HALVES == 2:
            tok1 = warpgroup_mma(p_op, v.tile(s * HALVES + 1), acc1 * alpha_o, is_async=True)
            acc0, acc1, p_op = warpgroup_mma_wait(0, deps=(tok0, tok1, p_op))
        else:
            acc0, p_op = warpgroup_mma_wait(0, deps=(tok0, p_op))
        v.release(s)
        c += 1
    return c, acc0, acc1, m_i, l_i


@gluon.jit
def _consumer(cfg, work, io, q_smem, k, v):
    """One warpgroup: load the packed query tile (row r: position r // GROUP of query head
    hk * GROUP + r % GROUP) into shared memory, fold the unmasked then the masked key blocks, and
    write out / lse (a split's partial when num_splits > 1)."""
    pid_m, split, off_hk, off_b, lo, mid, hi, causal_offset = work.program(cfg)
    GROUP: gl.constexpr = cfg.GROUP
    HALVES: gl.constexpr = cfg.HALVES
    o_layout: gl.constexpr = cfg.o_layout
    ld_layout: gl.constexpr = cfg.ld_layout
    row_layout: gl.constexpr = gl.SliceLayout(1, cfg.s_layout)
    seqlen_q = work.seqlen_q

    # -- the query tile, zero in padded rows --
    offs_r = pid_m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld_layout))
    offs_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld_layout))
    q_rows = (off_b.to(gl.int64) * io.stride_qb + (offs_r // GROUP) * io.stride_qs
              + (off_hk * GROUP + offs_r % GROUP) * io.stride_qh)
    r_ok = offs_r < GROUP * seqlen_q
    for h in gl.static_range(HALVES):
        q = gl.load(io.Q + q_rows[:, None] + (h * HALF + offs_c)[None, :], mask=r_ok[:, None], other=0.0)
        q_smem.index(h).store(q)
    fence_async_shared()
    gl.thread_barrier()

    # Per-row bounds of the masked loop: the range's end, and the row's diagonal (causal) or its
    # window's edges. Row r is query position r // GROUP of head hk * GROUP + r % GROUP.
    rows = pid_m * ROWS + gl.arange(0, ROWS, layout=row_layout)
    positions = rows // GROUP
    heads = off_hk * GROUP + rows % GROUP
    col_start = None
    if work.window.ON:
        col_limit = work.window.col_limit(positions, causal_offset, hi)
        if work.window.HAS_LEFT:
            col_start = work.window.col_start(positions, causal_offset, -seqlen_q)
    elif cfg.IS_CAUSAL:
        col_limit = gl.minimum(causal_col_limit(positions, causal_offset), hi)
    else:
        col_limit = gl.full([ROWS], 0, gl.int32, row_layout) + hi
    mod = io.scores.tile(off_b, heads, positions, causal_offset, PER_ROW=True)   # score variants (else a no-op)
    s_zero = gl.zeros([ROWS, cfg.BLOCK_N], gl.float32, cfg.s_layout)
    acc0 = gl.zeros([ROWS, HALF], gl.float32, o_layout)
    acc1 = gl.zeros([ROWS, HALF], gl.float32, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    c = 0
    c, acc0, acc1, m_i, l_i = _consume(cfg, q_smem, k, v, c, lo, mid, acc0, acc1, m_i, l_i, s_zero, mod, col_limit,
                                       col_start, io.qk_scale, False)
    c, acc0, acc1, m_i, l_i = _consume(cfg, q_smem, k, v, c, mid, hi, acc0, acc1, m_i, l_i, s_zero, mod, col_limit,
                                       col_start, io.qk_scale, True)

    # -- epilogue: out = acc / l, lse = m * sm_scale + ln(l); no visible key: 0 and -inf (with a
    # sink, one split: 0 and the sink; several splits: the merge adds it) --
    if io.scores.HAS_SINKS:
        sink = io.scores.sink(heads)
        acc1, _, _ = fold_sink(acc1, m_i, l_i, sink, io.sm_scale, io.qk_scale, o_layout)   # the same alpha
        acc0, m_i, l_i = fold_sink(acc0, m_i, l_i, sink, io.sm_scale, io.qk_scale, o_layout)
    lse, inv_l = finish_rows(m_i, l_i, io.sm_scale, o_layout)
    inv_l = inv_l[:, None]
    o_r = pid_m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    o_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    o_rows = (split.to(gl.int64) * io.stride_on + off_b.to(gl.int64) * io.stride_ob
              + (o_r // GROUP) * io.stride_os + (off_hk * GROUP + o_r % GROUP) * io.stride_oh)
    o_ok = (o_r < GROUP * seqlen_q)[:, None]
    out_ty: gl.constexpr = io.O.dtype.element_ty
    gl.store(io.O + o_rows[:, None] + o_c[None, :], (acc0 * inv_l).to(out_ty), mask=o_ok)
    if HALVES == 2:
        gl.store(io.O + o_rows[:, None] + (HALF + o_c)[None, :], (acc1 * inv_l).to(out_ty), mask=o_ok)
    l_rows = (split.to(gl.int64) * io.stride_ln + off_b.to(gl.int64) * io.stride_lb
              + (off_hk * GROUP + rows % GROUP) * io.stride_lh + rows // GROUP)
    gl.store(io.LSE + l_rows, lse.to(io.LSE.dtype.element_ty), mask=rows < GROUP * seqlen_q)


# Lengths and counts that change from one decode step to the next are not specialised (as in
# decode.py): a generation loop would otherwise recompile as they grow.
@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "seqlen_new", "num_m_blocks", "num_splits", "window_left",
                              "window_right"])
def _decode_hopper_kernel(
    Q, k_desc, v_desc, O, LSE, SEQLENS, BLOCK_TABLE,
    stride_qb, stride_qs, stride_qh,
    stride_on, stride_ob, stride_os, stride_oh,
    stride_ln, stride_lb, stride_lh,
    stride_sl, stride_btb, stride_btp,
    heads_kv, seqlen_q, seqlen_k, seqlen_new, num_m_blocks, num_splits,
    sm_scale, qk_scale,
    slope_scale, tanh_scale, softcap, ALIBI_SLOPES, stride_ab, stride_ah, SINKS,   # score variants, else None
    window_left, window_right,                                                     # a window, else None
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BOX: gl.constexpr,
    PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr, HAS_SEQLENS: gl.constexpr, IS_CAUSAL: gl.constexpr,
    STAGES: gl.constexpr, PRODUCER_REGS_: gl.constexpr,
    SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False, HAS_SINKS: gl.constexpr = False,
    HAS_LEFT: gl.constexpr = False, HAS_RIGHT: gl.constexpr = False,
):
    HALVES: gl.constexpr = HEAD_DIM // HALF
    dtype: gl.constexpr = k_desc.dtype
    cfg = DecConfig(GROUP, BLOCK_N, BOX, PAGE_SIZE, PAGED, HAS_SEQLENS, IS_CAUSAL, STAGES, HALVES)
    work = DecWork(SEQLENS, stride_sl, heads_kv, seqlen_q, seqlen_k, seqlen_new, num_m_blocks, num_splits,
                   Window(window_left, window_right, HAS_LEFT, HAS_RIGHT))
    scores = ScoreArgs(slope_scale, tanh_scale, softcap, ALIBI_SLOPES, stride_ab, stride_ah, SINKS, SOFTCAP, ALIBI,
                       HAS_SINKS, HEAD_DIM)
    io = DecIO(Q, O, LSE, stride_qb, stride_qs, stride_qh, stride_on, stride_ob, stride_os, stride_oh,
               stride_ln, stride_lb, stride_lh, sm_scale, qk_scale, scores)
    cache = DecCache(k_desc, v_desc, BLOCK_TABLE, stride_btb, stride_btp)
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HALF], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [HALVES, ROWS, HALF], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES * HALVES, BLOCK_N, HALF], tile_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES * HALVES, BLOCK_N, HALF], tile_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(v_empty.index(s), count=1)
    # The K and V rings: slot s holds HALVES tiles of 64 head-dim columns (mem index s * HALVES + h).
    k = Ring(k_smem, k_ready, k_empty, STAGES)
    v = Ring(v_smem, v_ready, v_empty, STAGES)
    gl.warp_specialize([
        (_consumer, (cfg, work, io, q_smem, k, v)),
        (_producer, (cfg, work, cache, k, v)),
    ], [1], [PRODUCER_REGS_])


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------

def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_table: torch.Tensor | None) -> bool:
    """True when this kernel handles the (validated) inputs: fp16/bf16 on an sm_90 GPU, head_dim 64
    or 128 (``configs.gluon_hopper_applies``), caches TMA can read (``tma_compatible``), and for a
    paged cache a power-of-two page size of at least MIN_BOX (a page's box must fill whole swizzle
    atoms of the shared-memory tile)."""
    if not q.is_cuda or not gluon_hopper_applies(head_dim=q.shape[-1], dtype=q.dtype, device=q.device):
        return False
    # Its query and output row offsets are int32: rows past 2^31 elements go to the Triton kernel,
    # which has 64-bit ones (LONG). (The output is allocated contiguous: rows of Hq x D.)
    if needs_int64_rows(q) or rows_past_int32(q.shape[1], q.shape[2] * q.shape[3], q.shape[3]):
        return False
    if block_table is not None:
        page_size = k_cache.shape[1]
        if page_size < MIN_BOX or page_size & (page_size - 1):
            return False
    return tma_compatible(k_cache, v_cache)


def programs_per_sm(head_dim: int, block_n: int, stages: int) -> int:
    """Programs of one tile resident per SM: two where their shared memory (the query tile and the
    K/V ring, plus 1 KiB for barriers and the reserve) fits twice, else one."""
    halves = head_dim // HALF.value
    smem = 2 * (halves * ROWS.value * HALF.value + 2 * stages * halves * block_n * HALF.value) + 1024
    return 2 if 2 * smem <= SHARED_PER_SM else 1


@on_input_device
def decode_hopper(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  o_part: torch.Tensor, l_part: torch.Tensor, cache_seqlens: torch.Tensor | None,
                  block_table: torch.Tensor | None, seqlen_new: int, sm_scale: float, causal: bool, *,
                  block_n: int, stages: int, num_splits: int, window: tuple[int, int] | None = None,
                  scores: ScoreVariant = PLAIN):
    """Launch on inputs dispatch.decode has prepared: o_part [N, B, Sq, Hq, D] and l_part
    [N, B, Hq, Sq] (N = num_splits; with N = 1 the final out and lse seen with a leading axis).
    ``supported`` must hold. ``window``: ``block_ranges.window_bounds``' (left, right), or None;
    ``scores``: the score variants (the sink is added here only with one split)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    group = heads_q // heads_kv
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else block_n
    box = min(page_size, block_n)
    num_m_blocks = cdiv(group * seqlen_q, ROWS.value)
    has_seqlens = cache_seqlens is not None
    grid = (batch * heads_kv * num_splits * num_m_blocks,)
    # Two programs per SM where their shared memory allows it: then each gets half the register file
    # (a launch limit of 128 per thread over its 8 warps, the producer's padded to a warpgroup, which
    # setmaxnreg then shares out between consumer and producer).
    maxnreg = 128 if programs_per_sm(head_dim, block_n, stages) == 2 else None
    launch.run(
        _decode_hopper_kernel, grid,
        Q=q, k_desc=descriptor(k_cache, box, HALF.value), v_desc=descriptor(v_cache, box, HALF.value), O=o_part,
        LSE=l_part, SEQLENS=cache_seqlens if has_seqlens else l_part, BLOCK_TABLE=block_table if paged else l_part,
        stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2),
        **partial_and_table_strides(o_part, l_part, cache_seqlens, block_table),
        heads_kv=heads_kv, seqlen_q=seqlen_q, seqlen_k=k_cache.shape[1], seqlen_new=seqlen_new,
        num_m_blocks=num_m_blocks, num_splits=num_splits,
        sm_scale=1.0 if natural_units(scores) else sm_scale, **score_launch_args(scores, sm_scale, sinks=False),
        **scores.sink_kwargs(in_kernel=num_splits == 1), **window_kernel_args(window),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_N=block_n, BOX=box, PAGE_SIZE=page_size, PAGED=paged,
        HAS_SEQLENS=has_seqlens, IS_CAUSAL=causal, STAGES=stages, PRODUCER_REGS_=DECODE_PRODUCER_REGS,
        num_warps=4, **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
