"""FlashAttention backward for Hopper (sm_90) in Gluon: dK and dV on the tensor cores, with or
without dQ.

A CTA keeps one 128-key block of one (batch, KV head): K and V in shared memory, dK and dV in
registers. It walks the query blocks that see those keys (every query head of the GQA group, so dK
and dV need no reduction across CTAs) and per block computes

    S^T = K Q^T,  P^T = exp2(S^T * scale * log2(e) - lse2),  dP^T = V dO^T,  dS^T = P^T * (dP^T - delta)
    dV += P^T dO,  dK += dS^T Q,  and in the fused form dQ_m += dS K.

* **dK and dV only** (variants ``dkdv``, ``dkdv_long``: what ``dispatch.backward_variant`` takes for
  deterministic calls, and for all at head dim 128, with windows and packed sequences): dQ
  comes from a kernel that keeps a query block and recomputes S and dP, the Gluon dQ kernel below
  (``_attn_bwd_dq_hopper_kernel``) or the portable Triton one (docs/hopper.md#backward-dk-and-dv-kernel,
  docs/hopper.md#backward-dq-kernel).
* **Fused** (variant ``split``): all three gradients in one pass, dQ partials added in a fixed order
  through per-block turn counters and a writer partition, so the result is bit-reproducible without
  atomics (docs/hopper.md#deterministic-dq-in-one-pass). Not chosen (slower than ``dkdv``); kept as
  the deterministic one-pass design and still tested on the GPU. ``split_atomic``: the same pass with
  the writer adding dQ by per-element atomics, in no fixed order (forced only), and ``split_tma`` by
  TMA reduce-adds of whole tiles: what ``deterministic=False`` takes at head dim 64 from 8k queries
  and keys (docs/hopper.md#atomic-dq-in-one-pass; dQ not reproducible).

Partitions: two consumer warpgroups (``_bwd_consumer``, 64 of the block's keys each), a producer warp
(``_bwd_producer``: TMA loads of K/V once and of Q/dO per step into a ring), and in the fused form a
writer (``_bwd_writer``). Numerics are backward.py's fp16/bf16 path: P recomputed from the base-2 LSE
(+inf for rows that saw no key, so their gradients are 0), fp32 accumulators, P and dS rounded to the
input dtype for their products. Rows past the ends read as zeros and are never stored.

Packed sequences (``varlen``, PACKED; the dK/dV-only variants and the dQ kernel): the forward's
layout (``sm90_common.Packed``), per-sequence lengths and first rows, rows of the next sequence zeroed
or masked where a tile runs past the end (docs/hopper.md#packed-sequences).
"""

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

from . import launch
from .block_ranges import (
    causal_key_end,
    causal_mask,
    causal_query_range,
    first_full_query_block,
    window_kernel_args,
)
from .common import PLAIN as NO_SCORES
from .common import ScoreVariant, Varlen, on_input_device
from .configs import cdiv, gluon_hopper_applies, sm_count
from .sm90_common import (
    PLAIN,
    PRODUCER_REGS,
    SCALAR,
    SMEM,
    Packed,
    Ring,
    ScoreArgs,
    Tiles,
    Window,
    aggregate,
    constexprs,
    descriptor,
    row_limits,
    score_launch_args,
    seen_cols,
    sequences,
    shared_layout,
    tma_reduce_add,
    tma_supported,
    zero_rows_past,
)

BLOCK_N = 128              # keys per CTA: 64 per consumer partition
NUM_WG = 2                 # consumer partitions (one warpgroup each)
SEM_STRIDE: gl.constexpr = gl.constexpr(32)   # int32 per turn counter: one 128-byte line each
# Launches of three warpgroups (two consumers and the producer's, no writer): the dK/dV-only form and
# the dQ kernel. maxnreg at launch, and what setmaxnreg then gives each consumer: what the producer
# gives up, up to setmaxnreg's 240 (FA3's split at head_dim 128).
MAXNREG_3WG = 65536 // (32 * 4 * 3) // 8 * 8
CONSUMER_REGS_3WG = min(240, (65536 - 128 * PRODUCER_REGS) // (128 * 2) // 8 * 8)

# name -> head_dim -> config. block_m: query rows per step; stages: Q/dO ring depth;
# dq_bufs: dQ partial buffers between the consumers and the writer (it takes two per round);
# writer_regs: the writer's setmaxnreg; dq: whether the kernel computes dQ too (the fused form) or
# dK and dV only. Measurements: docs/performance-notes.md#backward.
_SPLIT = dict(block_m=64, stages=2, dq_bufs=4, writer_regs=80, dq=True)
# dK and dV only: no writer, so the consumers get 240 registers a thread, which hold head_dim 128's dK
# and dV beside S^T and dP^T, and at head_dim 64 room for 128 queries a step.
_DKDV = dict(stages=2, dq=False)
VARIANTS = {
    # dq_kernel: where dQ comes from, this file's Gluon dQ kernel or the Triton one (faster at head
    # dim 64 below 4k keys, where its 64x64 tiles keep up).
    "dkdv": {64: dict(_DKDV, block_m=128, dq_kernel="triton"),
             128: dict(_DKDV, block_m=64, dq_kernel="gluon", dq_block_n=64, dq_stages=3)},
    # dQ from the Gluon kernel in 128-key tiles: head dim 64 from 4k keys.
    "dkdv_long": {64: dict(_DKDV, block_m=128, dq_kernel="gluon", dq_block_n=128, dq_stages=2)},
    # The fused, deterministic one-pass form (docs/hopper.md#deterministic-dq-in-one-pass): not chosen
    # (dkdv is faster), kept as the base of a one-pass backward and tested on the GPU.
    "split": {64: _SPLIT},
    # The same pass with the writer adding dQ's partials through atomics, in no fixed order: no turns
    # to wait for, not bit-reproducible (docs/hopper.md#atomic-dq-in-one-pass). Forced only: slower
    # than dkdv_long on the H100.
    "split_atomic": {64: dict(_SPLIT, atomic=True)},
    # The same, the writer adding each consumer's partial with one TMA reduce-add from shared memory
    # (cp.reduce.async.bulk.tensor; FlashAttention 3's arrangement) instead of per-element atomics.
    # The writer holds a slot only until its reduces have read it, so three slots do (and free the
    # shared memory for a third Q/dO stage).
    "split_tma": {64: dict(_SPLIT, atomic=True, tma_dq=True, dq_bufs=3, stages=3)},
}


STATS_TILE = 128      # every query tile of these kernels divides it
assert all(STATS_TILE % cfg["block_m"] == 0 for by_dim in VARIANTS.values() for cfg in by_dim.values())


def padded_rows(seqlen_q: int, packed: bool = False) -> int:
    """Rows per (batch, query head) of the delta / lse2 buffers the Gluon kernels read. Dense: whole
    query tiles (a multiple of STATS_TILE, so any of the kernels' tiles reads inside its own head's
    rows). Packed sequences (seqlen_q = total_q; the kernels read them by plain loads, masked at each
    sequence's end): a multiple of 4, so that the second buffer of the preprocess' pair starts 16-byte
    aligned, as the launch's (unused) TMA descriptor's base must."""
    if packed:
        return cdiv(seqlen_q, 4) * 4
    return cdiv(seqlen_q, STATS_TILE) * STATS_TILE


def reproducible(variant: str) -> bool:
    """Whether the variant's gradients are bit-identical from run to run (all but the atomic dQ form)."""
    return not next(iter(VARIANTS[variant].values())).get("atomic", False)


def computes_dq(variant: str) -> bool:
    """Whether the variant computes dQ too (the fused kernel), or dK and dV only."""
    return next(iter(VARIANTS[variant].values()))["dq"]


def variant_config(variant: str, head_dim: int) -> dict:
    cfg = dict(VARIANTS[variant][head_dim])
    cfg["num_warps"] = 4
    cfg.setdefault("atomic", False)
    cfg.setdefault("tma_dq", False)
    if cfg["dq"]:
        # Four warpgroups at launch: two consumers, the writer, and the producer's warp (Triton pads it
        # to a warpgroup), each thread with maxnreg registers: 128, the whole register file. setmaxnreg
        # then moves registers from the producer's warpgroup (PRODUCER_REGS) and the writer to the
        # consumers: the second consumer asks for consumer_regs, the first (the default partition)
        # gets the rest.
        cfg["maxnreg"] = 65536 // (32 * 4 * (NUM_WG + 2)) // 8 * 8
        spare = cfg["maxnreg"] * (NUM_WG + 2) - PRODUCER_REGS - cfg["writer_regs"]
        cfg["consumer_regs"] = spare // NUM_WG // 8 * 8
    else:
        cfg["maxnreg"], cfg["consumer_regs"] = MAXNREG_3WG, CONSUMER_REGS_3WG
        cfg.update(dq_bufs=2, writer_regs=0)     # unused without the writer
    return cfg


# --------------------------------------------------------------------------------------------------
# Kernel state
# --------------------------------------------------------------------------------------------------

@aggregate
class BwdConfig:
    """The compile-time configuration of a dK/dV launch (ATOMIC: the fused form's writer adds dQ
    through atomics instead of in turn; TMA_DQ: by TMA reduce-adds of whole tiles)."""
    HEAD_DIM: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    STAGES: gl.constexpr
    DQ_BUFS: gl.constexpr
    IS_CAUSAL: gl.constexpr
    NUM_WG: gl.constexpr
    DQ: gl.constexpr
    ATOMIC: gl.constexpr
    TMA_DQ: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_BUFS, IS_CAUSAL, NUM_WG, DQ, ATOMIC, TMA_DQ):
        constexprs(self, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, DQ_BUFS=DQ_BUFS,
                   IS_CAUSAL=IS_CAUSAL, NUM_WG=NUM_WG, DQ=DQ, ATOMIC=ATOMIC, TMA_DQ=TMA_DQ)


@aggregate
class BwdWork:
    """The problem's sizes and the grid's grouping (``_bwd_coords``): every partition derives its
    CTA's key block and steps from these, so they all walk the same steps. ``packed``: the sequences'
    layout (``sm90_common.Packed``; packed sequences: seqlen_q / seqlen_k and num_m_blocks are the
    longest sequence's, which size the grid)."""
    num_n_blocks: SCALAR
    num_heads_q: SCALAR
    num_heads_k: SCALAR
    kv_group_size: SCALAR
    seqlen_q: SCALAR
    seqlen_k: SCALAR
    num_m_blocks: SCALAR
    batch: SCALAR
    heads_per_group: SCALAR
    stats_rows: SCALAR
    window: Window
    packed: Packed

    @gluon.constexpr_function
    def __init__(self, num_n_blocks, num_heads_q, num_heads_k, kv_group_size, seqlen_q, seqlen_k, num_m_blocks,
                 batch, heads_per_group, stats_rows, window, packed):
        constexprs(self, num_n_blocks=num_n_blocks, num_heads_q=num_heads_q, num_heads_k=num_heads_k,
                   kv_group_size=kv_group_size, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_m_blocks=num_m_blocks,
                   batch=batch, heads_per_group=heads_per_group, stats_rows=stats_rows)
        self.window = window
        self.packed = packed

    @gluon.jit
    def coords(self, cfg):
        """``_bwd_coords``: (pid_n, batch, KV head, first key, steps, first query block, its step, and
        the sequence's first query row q0, first key row k0, seqlen_q and seqlen_k)."""
        return _bwd_coords(self.num_n_blocks, self.num_heads_k, self.kv_group_size, self.seqlen_q, self.seqlen_k,
                           self.num_m_blocks, self.batch, self.heads_per_group, self.window, self.packed,
                           cfg.BLOCK_M, cfg.BLOCK_N, cfg.IS_CAUSAL)

    @gluon.jit
    def live(self, start_n, seqlen_k):
        """Whether the CTA's key block (first key start_n) holds a key: packed sequences, whose grid is
        sized by the longest one, have blocks past a sequence's keys, which load and store nothing."""
        if self.packed.ON:
            return start_n < seqlen_k
        else:
            return True

    @gluon.jit
    def stats_row(self, off_b, off_h, row):
        """Where query row ``row`` of the sequence of batch entry off_b, query head off_h, lies in the
        flat lse2 / delta buffers: [B, Hq, stats_rows] dense, [1, Hq, total_q] packed (``row`` then
        counts from the packed tensors' first row)."""
        return (self.packed.batch_index(off_b) * self.num_heads_k * self.kv_group_size + off_h) * self.stats_rows \
            + row


@aggregate
class BwdShared:
    """A CTA's shared memory: its K and V block (``kv_ready`` once), the ring of steps (``q``: the Q
    tiles with ``q_ready`` / ``q_empty``; ``do``, ``lse``, ``delta`` share its slots and barriers) and,
    fused (DQ), dS^T and the ring of dQ partials the consumers hand the writer (``dq``: ready = full)."""
    k: SMEM
    v: SMEM
    kv_ready: SMEM
    q: Ring
    do: SMEM
    lse: SMEM
    delta: SMEM
    ds: SMEM
    dq: Ring

    @gluon.constexpr_function
    def __init__(self, k, v, kv_ready, q, do, lse, delta, ds, dq):
        constexprs(self, k=k, v=v, kv_ready=kv_ready, q=q, do=do, lse=lse, delta=delta, ds=ds, dq=dq)


@aggregate
class BwdIO:
    """What the partitions read and write in global memory: Q, K, V, dO, lse2 and delta through TMA
    descriptors (the producer), dK and dV by pointer and strides (the consumers), the dQ workspace and
    its turn counters (the writer; TMA_DQ: DQW is a descriptor over the workspace as [B * Hq, rows, D]),
    the scales (qk_scale: log2(e) with softcap, whose scores are in
    natural units; sm_scale: dK's and dQ's factor), the score variants (``scores``) and, packed,
    lse2 and delta by pointer (``_load_stats``)."""
    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    do_desc: tma.tensor_descriptor
    lse_desc: tma.tensor_descriptor
    delta_desc: tma.tensor_descriptor
    DK: gl.tensor
    DV: gl.tensor
    DQW: (gl.tensor, tma.tensor_descriptor)
    SEM: gl.tensor
    stride_dkb: SCALAR
    stride_dks: SCALAR
    stride_dkh: SCALAR
    stride_dvb: SCALAR
    stride_dvs: SCALAR
    stride_dvh: SCALAR
    sm_scale: gl.tensor
    qk_scale: gl.tensor
    scores: ScoreArgs
    LSE2: SCALAR
    DELTA: SCALAR

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV, DQW, SEM, stride_dkb,
                 stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, sm_scale, qk_scale, scores,
                 LSE2=None, DELTA=None):
        constexprs(self, q_desc=q_desc, k_desc=k_desc, v_desc=v_desc, do_desc=do_desc, lse_desc=lse_desc,
                   delta_desc=delta_desc, DK=DK, DV=DV, DQW=DQW, SEM=SEM, stride_dkb=stride_dkb,
                   stride_dks=stride_dks, stride_dkh=stride_dkh, stride_dvb=stride_dvb, stride_dvs=stride_dvs,
                   stride_dvh=stride_dvh, sm_scale=sm_scale, qk_scale=qk_scale, LSE2=LSE2, DELTA=DELTA)
        self.scores = scores


# --------------------------------------------------------------------------------------------------
# Work of one CTA
# --------------------------------------------------------------------------------------------------

@gluon.jit
def _bwd_coords(num_n_blocks, num_heads_k, kv_group_size, seqlen_q, seqlen_k, num_m_blocks, batch,
                heads_per_group, window, packed, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                IS_CAUSAL: gl.constexpr):
    """This CTA's (batch, KV head, key block) and its steps. Step i visits query block
    m = m_first + m_step * (i // G) of query head hk * G + i % G (G = kv_group_size), for i in
    [0, n_steps): every query block from the first one that sees a key of the block (m_lo) on (with
    a ``Window``, up to the last one that does: ``block_ranges.window_query_range``).

    Program ids go over groups of ``heads_per_group`` (batch, KV head) pairs, about one wave of the
    GPU; inside a group the key block varies slowest, from the last one down:
    pid = group base + (N - 1 - n) * heads + head. So key block n + 1 of a head (the CTA whose dQ turn
    n waits for) has the smaller id, and when the CTAs of key block n of one group finish, the CTAs
    that take their SMs are key block n of the next group: each starts about one turn after the one
    it waits for, and the wave's pipeline fill is paid once.

    Packed sequences (``packed.ON``): batch entry b is sequence b, from row q0 of q and k0 of k; its
    own lengths and query blocks set the steps (a key block past its keys does nothing:
    ``BwdWork.live``). Dense: q0 = k0 = 0 and the launch's lengths."""
    pid = gl.program_id(0)
    group_size = heads_per_group * num_n_blocks
    group = pid // group_size
    heads = gl.minimum(heads_per_group, batch * num_heads_k - group * heads_per_group)
    r = pid - group * group_size
    pid_n = num_n_blocks - 1 - r // heads
    bh = group * heads_per_group + r % heads
    off_hk = bh % num_heads_k
    off_b = bh // num_heads_k
    start_n = pid_n * BLOCK_N
    if packed.ON:
        q0, k0, seqlen_q, seqlen_k = packed.sequence(off_b, True)
        num_m_blocks = gl.cdiv(seqlen_q, BLOCK_M)
    else:
        q0 = 0
        k0 = 0
    if window.ON:
        # The query blocks whose windows hold a key of the block, from the first one up.
        lo, _, _, hi = window.query_rows(start_n, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N)
        m_first = lo // BLOCK_M
        n_steps = gl.maximum(gl.cdiv(hi, BLOCK_M) - m_first, 0) * kv_group_size
        m_step = 1
    else:
        # The first query block that sees a key of the block (bottom-right alignment).
        lo, _ = causal_query_range(start_n, seqlen_q, seqlen_k, num_m_blocks * BLOCK_M, BLOCK_M, BLOCK_N,
                                   IS_CAUSAL)
        m_lo = lo // BLOCK_M
        n_steps = gl.maximum(num_m_blocks - m_lo, 0) * kv_group_size
        # Non-causal: from the last query block down; causal: from the diagonal up, so that key block
        # n reaches block m at step m - m_lo(n), after key block n + 1 did (see the module docstring).
        if IS_CAUSAL:
            m_first = m_lo
            m_step = 1
        else:
            m_first = num_m_blocks - 1
            m_step = -1
    return pid_n, off_b, off_hk, start_n, n_steps, m_first, m_step, q0, k0, seqlen_q, seqlen_k


@gluon.jit
def _step_block(i, m_first, m_step, off_hk, kv_group_size):
    """Step i's query block m and query head (``_bwd_coords``): every partition walks the same steps."""
    return m_first + m_step * (i // kv_group_size), off_hk * kv_group_size + i % kv_group_size


@gluon.jit
def _load_stats(io, lse_slot, delta_slot, row, n, ROWS: gl.constexpr):
    """Packed sequences: ROWS entries of lse2 and delta from flat position ``row`` (``io.LSE2``,
    ``io.DELTA``) into their ring slots by plain loads, by the producer's one warp before it arms the
    slot's barrier (whose arrive publishes the stores). A sequence starts at any row, and a 1-D TMA box
    must start 16-byte aligned (else: illegal instruction). Entries from ``n`` on, past the sequence's
    end, read as a row that sees no key: lse2 = +inf, delta = 0, so p and dS are 0 there."""
    layout: gl.constexpr = gl.BlockedLayout([ROWS // 32], [32], [1], [0])
    offs = gl.arange(0, ROWS, layout=layout)
    inside = offs < n
    lse_slot.store(gl.load(io.LSE2 + row + offs, mask=inside, other=float("inf")))
    delta_slot.store(gl.load(io.DELTA + row + offs, mask=inside, other=0.0))
    gl.thread_barrier()


@gluon.jit
def _bwd_producer(cfg, work, io, sh):
    """K and V once; per step the Q and dO tiles and the step's BLOCK_M entries of lse2 and delta
    (``BwdWork.stats_row``): dense by TMA from flat descriptors (a tile never straddles two heads),
    packed by plain loads (``_load_stats``)."""
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    pid_n, off_b, off_hk, start_n, n_steps, m_first, m_step, q0, k0, seqlen_q, seqlen_k = work.coords(cfg)
    desc_b = work.packed.batch_index(off_b)
    if work.live(start_n, seqlen_k):
        mbarrier.expect(sh.kv_ready, io.k_desc.block_type.nbytes + io.v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(io.k_desc, [desc_b, k0 + start_n, off_hk, 0], sh.kv_ready, sh.k)
        tma.async_copy_global_to_shared(io.v_desc, [desc_b, k0 + start_n, off_hk, 0], sh.kv_ready, sh.v)
        for i in range(n_steps):
            s = sh.q.index(i)
            m, off_h = _step_block(i, m_first, m_step, off_hk, work.kv_group_size)
            sh.q.acquire(i)
            if work.packed.ON:
                _load_stats(io, sh.lse.index(s), sh.delta.index(s), work.stats_row(off_b, off_h, q0 + m * BLOCK_M),
                            seqlen_q - m * BLOCK_M, BLOCK_M)
                sh.q.expect(s, io.q_desc.block_type.nbytes + io.do_desc.block_type.nbytes)
            else:
                sh.q.expect(s, io.q_desc.block_type.nbytes + io.do_desc.block_type.nbytes
                            + 2 * io.lse_desc.block_type.nbytes)
            sh.q.load(io.q_desc, [desc_b, q0 + m * BLOCK_M, off_h, 0], s)
            tma.async_copy_global_to_shared(io.do_desc, [desc_b, q0 + m * BLOCK_M, off_h, 0], sh.q.ready.index(s),
                                            sh.do.index(s))
            if not work.packed.ON:
                row = work.stats_row(off_b, off_h, q0 + m * BLOCK_M)
                tma.async_copy_global_to_shared(io.lse_desc, [row], sh.q.ready.index(s), sh.lse.index(s))
                tma.async_copy_global_to_shared(io.delta_desc, [row], sh.q.ready.index(s), sh.delta.index(s))


@gluon.jit
def _bwd_step(cfg, sh, WG: gl.constexpr, i, dk, dv, zero_st, zero_dq, k_smem, v_smem, ds_smem, keys, cols0,
              seqlen_k, m_first, m_step, kv_group_size, causal_offset, qk_scale, col_layout: gl.constexpr,
              a_layout: gl.constexpr, MASK: gl.constexpr, scores, off_b, off_hk, q_first=None, q_last=None,
              q_end=None, ld_layout: gl.constexpr = None):
    """One (query block, key block) step of a consumer partition (its key rows: ``k_smem``, ``v_smem``,
    ``ds_smem``): returns the updated dK, dV and (DQ) hands its dQ partial to the writer. MASK (compile
    time, so a step has no branch): 0 none, 1 the causal diagonal, 2 the key rows past seqlen_k, 3 a
    window: key row j is seen by the queries [q_first[j], q_last[j]] (``Window.first_query``, ``last_query``; none
    for key rows past seqlen_k). The caller runs each kind of step in its own loop. (Issuing the next
    step's S^T / dP^T before waiting for this step's products was tried: ptxas then serialises the
    wgmmas, C7514.) ``scores``: softcap and ALiBi on the step's scores (query head and slope per step)
    and softcap's factor on dS. ``q_end`` (packed sequences: the sequence's seqlen_q): the block's rows
    from q_end on are the next sequence's, so their Q and dO rows are zeroed in the slot (0 * NaN is
    NaN on the tensor cores; ``zero_rows_past``, in ``ld_layout``); their lse2 / delta came in as +inf / 0
    (``_load_stats``): p and dS are then 0 there, as for the zero rows TMA reads past a dense
    tensor's end."""
    dtype: gl.constexpr = sh.q.mem.dtype
    s = sh.q.index(i)
    q_tile = sh.q.tile(s)
    do_tile = sh.do.index(s)
    sh.q.wait(i)
    if q_end is not None:
        m_tail, _ = _step_block(i, m_first, m_step, off_hk, kv_group_size)
        # Both consumer partitions zero the slot's rows (the same values), each before its products.
        zero_rows_past(q_tile, m_tail, q_end, cfg.BLOCK_M, ld_layout, do_tile)
    st_tok = warpgroup_mma(k_smem, q_tile.permute((1, 0)), zero_st, use_acc=False, is_async=True)
    dpt_tok = warpgroup_mma(v_smem, do_tile.permute((1, 0)), zero_st, use_acc=False, is_async=True)
    m, off_h = _step_block(i, m_first, m_step, off_hk, kv_group_size)
    cols = m * cfg.BLOCK_M + cols0                                 # query positions
    s_t = warpgroup_mma_wait(1, deps=(st_tok,))
    if scores.SOFTCAP or scores.ALIBI:
        s_t, g_t = scores.tile(off_b, off_h, keys, -causal_offset).apply_grad(s_t, cols)
    # Rows past seqlen_q (and rows that saw no key) have lse2 = +inf: their p is 0.
    p_t = gl.exp2(s_t * qk_scale - sh.lse.index(s).load(col_layout)[None, :])
    if MASK == 1:
        # Causal: keys after a row's diagonal (which include every key past seqlen_k) get p = 0.
        p_t = gl.where(causal_mask(cols[None, :], keys[:, None], causal_offset), p_t, 0.0)
    elif MASK == 2:
        # Key rows past seqlen_k read as zeros, so their score is 0 and p = exp2(-lse2), which is huge
        # when every real score of a row is very negative: dS would overflow to inf and inf * 0 (the
        # zero K row) would put NaN into dQ. Their p is set to 0.
        p_t = gl.where(keys[:, None] < seqlen_k, p_t, 0.0)
    elif MASK == 3:
        seen = cols[None, :] >= q_first[:, None]
        if q_last is not None:
            seen = seen & (cols[None, :] <= q_last[:, None])
        p_t = gl.where(seen, p_t, 0.0)
    dp_t = warpgroup_mma_wait(0, deps=(dpt_tok,))
    if scores.SOFTCAP:
        ds_t = (p_t * (dp_t - sh.delta.index(s).load(col_layout)[None, :]) * g_t).to(dtype)
    else:
        ds_t = (p_t * (dp_t - sh.delta.index(s).load(col_layout)[None, :])).to(dtype)
    p_a = gl.convert_layout(p_t.to(dtype), a_layout)
    ds_a = gl.convert_layout(ds_t, a_layout)
    dv_tok = warpgroup_mma(p_a, do_tile, dv, is_async=True)
    dk_tok = warpgroup_mma(ds_a, q_tile, dk, is_async=True)
    if cfg.DQ:
        # dQ (this partition's share: its keys) = dS K, with dS^T read back from shared memory,
        # transposed.
        ds_smem.store(ds_t)
        fence_async_shared()
        gl.thread_barrier()
        dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, zero_dq, use_acc=False, is_async=True)
        dv, dk, dq, p_a, ds_a = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok, p_a, ds_a))
        sh.q.release(s, True)                # after every warp of the partition is past its wait
        b = sh.dq.index(i)
        sh.dq.acquire(i)
        sh.dq.tile(b * cfg.NUM_WG + WG).store(dq)
        if cfg.TMA_DQ:
            fence_async_shared()             # the writer's TMA (the async proxy) reads what was stored
        gl.thread_barrier()
        mbarrier.arrive(sh.dq.ready.index(b), count=1)
    else:
        dv, dk, p_a, ds_a = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_a, ds_a))
        sh.q.release(s, True)                # after every warp of the partition is past its wait
    return dk, dv


@gluon.jit
def _bwd_consumer(cfg, WG: gl.constexpr, work, io, sh):
    """Consumer partition WG of NUM_WG: the CTA's key block, if it holds a key (``_bwd_keys``)."""
    pid_n, off_b, off_hk, start_n, n_steps, m_first, m_step, q0, k0, seqlen_q, seqlen_k = work.coords(cfg)
    if work.live(start_n, seqlen_k):
        _bwd_keys(cfg, WG, work, io, sh, off_b, off_hk, start_n, n_steps, m_first, m_step, k0, seqlen_q, seqlen_k)


@gluon.jit
def _bwd_keys(cfg, WG: gl.constexpr, work, io, sh, off_b, off_hk, start_n, n_steps, m_first, m_step, k0, seqlen_q,
              seqlen_k):
    """Consumer partition WG of NUM_WG (one warpgroup each): key rows [WG * KEYS, WG * KEYS + KEYS) of
    the CTA's block, KEYS = BLOCK_N / NUM_WG = 64 (first key start_n of the sequence whose first key
    row is k0). The partitions run unsynchronised, so one's softmax overlaps the other's products."""
    dtype: gl.constexpr = sh.q.mem.dtype
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    KEYS: gl.constexpr = cfg.BLOCK_N // cfg.NUM_WG
    gl.static_assert(KEYS == 64, "a consumer partition is one warpgroup: 64 key rows")
    kv_group_size = work.kv_group_size
    start_n = start_n + WG * KEYS
    # Packed sequences: the steps mask the rows past the sequence's end (``_bwd_step``'s q_end).
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
    if work.packed.ON:
        q_end = seqlen_q
    else:
        q_end = None
    k_smem = sh.k.slice(WG * KEYS, KEYS)
    v_smem = sh.v.slice(WG * KEYS, KEYS)
    if cfg.DQ:
        ds_smem = sh.ds.slice(WG * KEYS, KEYS)
    else:
        ds_smem = sh.ds                      # not read
    # wgmma accumulators: S^T, dP^T [KEYS, BM], dK, dV [KEYS, D] and dQ [BM, D], 4 warps on the rows.
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)             # one value per query
    key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)             # one value per key
    cols0 = gl.arange(0, BLOCK_M, layout=col_layout)
    keys = start_n + gl.arange(0, KEYS, layout=key_layout)
    causal_offset = seqlen_k - seqlen_q
    key_tail = start_n + KEYS > seqlen_k                 # this partition holds key rows past the end
    if work.window.ON:
        # Query blocks [m_full, m_end) see every key of this partition's rows: no mask; the others
        # need the window's (and where key_tail, the end of the keys).
        _, full_lo, full_hi, _ = work.window.query_rows(start_n, seqlen_q, seqlen_k, BLOCK_M, KEYS)
        m_full = full_lo // BLOCK_M
        m_end = full_hi // BLOCK_M
        q_first = work.window.first_query(keys, causal_offset, seqlen_k)
        q_last = None
        if work.window.HAS_LEFT:
            q_last = work.window.last_query(keys, causal_offset)
    elif cfg.IS_CAUSAL:
        # Query blocks from m_full on see every key of this partition's rows (no mask needed).
        m_full = first_full_query_block(start_n, seqlen_q, seqlen_k, BLOCK_M, KEYS)
    else:
        m_full = 0

    zero_st = gl.zeros([KEYS, BLOCK_M], gl.float32, st_layout)
    zero_dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, kv_layout)
    mbarrier.wait(sh.kv_ready, 0)
    # Steps by the mask they need, each kind in its own loop (no branch inside a step): causal, the
    # query blocks below m_full (the first steps: they go up from the diagonal); then the rest, with
    # the key-tail mask where this partition holds key rows past seqlen_k. (The three calls written
    # as one gl.static_range(3) over the mask kind spill 8-16 bytes at head_dim 128.)
    if work.window.ON:
        # The window's masked steps (query blocks below m_full), the unmasked ones (up to m_end),
        # the masked ones after them; all masked in a partition that holds key rows past the end.
        n_front = gl.minimum(gl.maximum(m_full - m_first, 0) * kv_group_size, n_steps)
        n_mid = gl.minimum(gl.maximum(m_end - m_first, 0) * kv_group_size, n_steps)
        if key_tail:
            n_front = n_steps
        n_mid = gl.maximum(n_mid, n_front)
        for i in range(0, n_front):
            dk, dv = _bwd_step(cfg, sh, WG, i, dk, dv, zero_st, zero_dq, k_smem, v_smem, ds_smem, keys, cols0,
                               seqlen_k, m_first, m_step, kv_group_size, causal_offset, io.qk_scale, col_layout,
                               a_layout, 3, io.scores, off_b, off_hk, q_first, q_last, q_end=q_end, ld_layout=ld_layout)
        for i in range(n_front, n_mid):
            dk, dv = _bwd_step(cfg, sh, WG, i, dk, dv, zero_st, zero_dq, k_smem, v_smem, ds_smem, keys, cols0,
                               seqlen_k, m_first, m_step, kv_group_size, causal_offset, io.qk_scale, col_layout,
                               a_layout, 0, io.scores, off_b, off_hk, q_end=q_end, ld_layout=ld_layout)
        for i in range(n_mid, n_steps):
            dk, dv = _bwd_step(cfg, sh, WG, i, dk, dv, zero_st, zero_dq, k_smem, v_smem, ds_smem, keys, cols0,
                               seqlen_k, m_first, m_step, kv_group_size, causal_offset, io.qk_scale, col_layout,
                               a_layout, 3, io.scores, off_b, off_hk, q_first, q_last, q_end=q_end, ld_layout=ld_layout)
    else:
        if cfg.IS_CAUSAL:
            n_masked = gl.minimum(gl.maximum(m_full - m_first, 0) * kv_group_size, n_steps)
            for i in range(0, n_masked):
                dk, dv = _bwd_step(cfg, sh, WG, i, dk, dv, zero_st, zero_dq, k_smem, v_smem, ds_smem, keys, cols0,
                                   seqlen_k, m_first, m_step, kv_group_size, causal_offset, io.qk_scale, col_layout,
                                   a_layout, 1, io.scores, off_b, off_hk, q_end=q_end, ld_layout=ld_layout)
        else:
            n_masked = 0
        if key_tail:
            for i in range(n_masked, n_steps):
                dk, dv = _bwd_step(cfg, sh, WG, i, dk, dv, zero_st, zero_dq, k_smem, v_smem, ds_smem, keys, cols0,
                                   seqlen_k, m_first, m_step, kv_group_size, causal_offset, io.qk_scale, col_layout,
                                   a_layout, 2, io.scores, off_b, off_hk, q_end=q_end, ld_layout=ld_layout)
        else:
            for i in range(n_masked, n_steps):
                dk, dv = _bwd_step(cfg, sh, WG, i, dk, dv, zero_st, zero_dq, k_smem, v_smem, ds_smem, keys, cols0,
                                   seqlen_k, m_first, m_step, kv_group_size, causal_offset, io.qk_scale, col_layout,
                                   a_layout, 0, io.scores, off_b, off_hk, q_end=q_end, ld_layout=ld_layout)

    # -- epilogue: dK * sm_scale and dV; key rows past seqlen_k are not stored --
    out_keys = start_n + gl.arange(0, KEYS, layout=gl.SliceLayout(1, kv_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    mask = (out_keys < seqlen_k)[:, None]
    if work.packed.ON:                   # [1, total_k, Hkv, D]: the sequence's rows from k0
        rows = (k0 + out_keys)[:, None].to(gl.int64)
        dk_ptrs = io.DK + off_hk.to(gl.int64) * io.stride_dkh + rows * io.stride_dks + dims[None, :]
        dv_ptrs = io.DV + off_hk.to(gl.int64) * io.stride_dvh + rows * io.stride_dvs + dims[None, :]
    else:
        dk_ptrs = io.DK + off_b.to(gl.int64) * io.stride_dkb + off_hk.to(gl.int64) * io.stride_dkh \
            + out_keys[:, None].to(gl.int64) * io.stride_dks + dims[None, :]
        dv_ptrs = io.DV + off_b.to(gl.int64) * io.stride_dvb + off_hk.to(gl.int64) * io.stride_dvh \
            + out_keys[:, None].to(gl.int64) * io.stride_dvs + dims[None, :]
    gl.store(dk_ptrs, (dk * io.sm_scale).to(dtype), mask=mask)
    gl.store(dv_ptrs, dv.to(dtype), mask=mask)


@gluon.jit
def _wait_turn(sem_ptr, turn):
    """Every thread polls the counter with an acquire load until it reads ``turn`` (or more): its own
    later loads then see everything the previous writer stored before its release."""
    seen = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [sem_ptr],
                                     dtype=gl.int32, is_pure=False, pack=1)
    while seen < turn:
        seen = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [sem_ptr],
                                         dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pass_turns(sem0, sem1, value0, value1):
    """Release two counters: after a barrier of the (4-warp) partition, so that every thread's stores are
    issued, its first thread stores value0 / value1 with release semantics (CUTLASS's semaphore does
    the same)."""
    gl.thread_barrier()
    gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; and.b32 t, t, 127; setp.eq.u32 p, t, 0; "
        "@p st.release.gpu.global.b32 [$1], $3; @p st.release.gpu.global.b32 [$2], $4; mov.b32 $0, 0; }",
        "=r,l,l,r,r", [sem0, sem1, value0, value1], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dq_turn(i, pid_n, num_n_blocks, m_first, m_step, kv_group_size, seqlen_q, seqlen_k,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Key block pid_n's place in the order of additions into step i's query block m: the blocks
    that add into m are 0 .. n_max(m) (causal: those whose first key some row of m sees), and they
    add from n_max(m) down to 0, so the place is n_max(m) - pid_n."""
    m = m_first + m_step * (i // kv_group_size)
    if IS_CAUSAL:
        # The key block of the last row's diagonal.
        n_max = gl.minimum(num_n_blocks - 1, (causal_key_end(m * BLOCK_M, seqlen_q, seqlen_k, BLOCK_M) - 1) // BLOCK_N)
    else:
        n_max = num_n_blocks - 1
    return n_max - pid_n


@gluon.jit
def _dq_block(i, SEM, DQW, off_b, off_hk, kv_group_size, num_heads_q, num_m_blocks, m_first, m_step,
              BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Step i's turn counter and workspace tile (query block m of query head hk * G + i % G)."""
    m = m_first + m_step * (i // kv_group_size)
    bh = off_b * num_heads_q + off_hk * kv_group_size + i % kv_group_size
    return SEM + (bh * num_m_blocks + m) * SEM_STRIDE, DQW + (bh.to(gl.int64) * num_m_blocks + m) * (BLOCK_M * HEAD_DIM)


@gluon.jit
def _dq_partial(dq_smem, b, c, CHUNK: gl.constexpr, NUM_WG: gl.constexpr, layout: gl.constexpr):
    """Rows [c * CHUNK, c * CHUNK + CHUNK) of buffer b's partial: the consumers' shares in a fixed order."""
    part = dq_smem.index(b * NUM_WG).slice(c * CHUNK, CHUNK).load(layout)
    for w in gl.static_range(1, NUM_WG):
        part += dq_smem.index(b * NUM_WG + w).slice(c * CHUNK, CHUNK).load(layout)
    return part


@gluon.jit
def _bwd_writer(cfg, work, io, sh, THREADS: gl.constexpr):
    """Adds each step's dQ partial (the ``sh.dq`` ring, from the consumers) into workspace rows
    [m * BM, m * BM + BM) of its (batch, query head): ATOMIC, by atomic adds into a zeroed workspace,
    one step at a time and in no fixed order (SEM is not read), per element or (TMA_DQ) one TMA
    reduce-add per consumer's tile; else in key-block order. DQW is [B, Hq, num_m_blocks * BM, D] fp32
    (TMA_DQ: a descriptor over it as [B * Hq, num_m_blocks * BM, D]), SEM [B, Hq, num_m_blocks,
    SEM_STRIDE] int32.

    Two steps per round: both turns are awaited, both tiles loaded, summed, stored and released
    together, so one round trip to L2 (and one release) serves two steps. Their counters are different
    (two query blocks), and a round only waits on what the previous key block released in its own
    round for the same two steps, so the chains stay one step deep. With an odd step count the last
    round's second step is the first one again, masked off (its release rewrites the same value)."""
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    IS_CAUSAL: gl.constexpr = cfg.IS_CAUSAL
    NUM_WG: gl.constexpr = cfg.NUM_WG
    num_n_blocks = work.num_n_blocks
    kv_group_size = work.kv_group_size
    num_m_blocks = work.num_m_blocks
    DQW = io.DQW
    SEM = io.SEM
    pid_n, off_b, off_hk, start_n, n_steps, m_first, m_step, q0, k0, seqlen_q, seqlen_k = work.coords(cfg)
    num_heads_q = work.num_heads_k * kv_group_size
    # 4 fp32 (16 bytes) per thread along D; CHUNK rows at a time (16 values per thread and step: 32 made
    # no difference).
    TPR: gl.constexpr = HEAD_DIM // 4                     # threads per row
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TPR, TPR], [THREADS // 32, 1], [1, 0])
    CHUNK: gl.constexpr = (THREADS * 16) // HEAD_DIM
    rows0 = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    offs = rows0[:, None] * HEAD_DIM + dims[None, :]
    if cfg.TMA_DQ:
        # Each consumer's share goes into the (zeroed) workspace by one TMA reduce-add from shared
        # memory (L2 adds it; no registers, no per-element atomics), in no fixed order; the slot is
        # released once the reduces have read it.
        for j in range(n_steps):
            b = sh.dq.index(j)
            m, off_h = _step_block(j, m_first, m_step, off_hk, kv_group_size)
            sh.dq.wait(j)
            for w in gl.static_range(NUM_WG):
                tma_reduce_add(DQW, [off_b * num_heads_q + off_h, m * BLOCK_M, 0], sh.dq.tile(b * NUM_WG + w))
            tma.store_wait(0)
            sh.dq.release(b)
    elif cfg.ATOMIC:
        # Each step's partial goes into the (zeroed) workspace by relaxed fp32 atomic adds, as soon as
        # the consumers hand it over: no turn, so the order of the additions, and the last bits of
        # dQ, vary from run to run.
        for j in range(n_steps):
            b = sh.dq.index(j)
            _, base = _dq_block(j, SEM, DQW, off_b, off_hk, kv_group_size, num_heads_q, num_m_blocks, m_first,
                                m_step, BLOCK_M, HEAD_DIM)
            sh.dq.wait(j)
            for c in gl.static_range(BLOCK_M // CHUNK):
                gl.atomic_add(base + c * CHUNK * HEAD_DIM + offs, _dq_partial(sh.dq.mem, b, c, CHUNK, NUM_WG, layout),
                              sem="relaxed")
            sh.dq.release(b)
    else:
        for j in range(0, n_steps, 2):
            j1 = gl.minimum(j + 1, n_steps - 1)
            has1 = j + 1 < n_steps
            turn0 = _dq_turn(j, pid_n, num_n_blocks, m_first, m_step, kv_group_size, work.seqlen_q, work.seqlen_k,
                             BLOCK_M, BLOCK_N, IS_CAUSAL)
            turn1 = _dq_turn(j1, pid_n, num_n_blocks, m_first, m_step, kv_group_size, work.seqlen_q, work.seqlen_k,
                             BLOCK_M, BLOCK_N, IS_CAUSAL)
            sem0, base0 = _dq_block(j, SEM, DQW, off_b, off_hk, kv_group_size, num_heads_q, num_m_blocks, m_first,
                                    m_step, BLOCK_M, HEAD_DIM)
            sem1, base1 = _dq_block(j1, SEM, DQW, off_b, off_hk, kv_group_size, num_heads_q, num_m_blocks, m_first,
                                    m_step, BLOCK_M, HEAD_DIM)
            b0 = sh.dq.index(j)
            b1 = sh.dq.index(j1)
            sh.dq.wait(j)
            sh.dq.wait(j1, pred=has1)
            _wait_turn(sem0, turn0)
            _wait_turn(sem1, turn1)
            for c in gl.static_range(BLOCK_M // CHUNK):
                ptr0 = base0 + c * CHUNK * HEAD_DIM + offs
                ptr1 = base1 + c * CHUNK * HEAD_DIM + offs
                # The first contribution to a block (turn 0) is stored as it is: no load.
                x0 = gl.load(ptr0, mask=turn0 > 0, other=0.0, cache_modifier=".cg")
                x1 = gl.load(ptr1, mask=has1 & (turn1 > 0), other=0.0, cache_modifier=".cg")
                gl.store(ptr0, x0 + _dq_partial(sh.dq.mem, b0, c, CHUNK, NUM_WG, layout))
                gl.store(ptr1, x1 + _dq_partial(sh.dq.mem, b1, c, CHUNK, NUM_WG, layout), mask=has1)
            # (Gluon's arrive is a barrier of the partition, then one thread's arrive: every warp has read
            # the buffers before the consumers may refill them.)
            sh.dq.release(b0)
            sh.dq.release(b1, pred=has1)
            _pass_turns(sem0, sem1, turn0 + 1, turn1 + 1)


@gluon.jit(do_not_specialize=["num_n_blocks", "num_heads_q", "num_heads_k", "kv_group_size", "seqlen_q",
                              "seqlen_k", "num_m_blocks", "batch", "heads_per_group", "window_left",
                              "window_right"])
def _attn_bwd_hopper_kernel(
    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV, DQW, SEM,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    num_n_blocks, num_heads_q, num_heads_k, kv_group_size, seqlen_q, seqlen_k, num_m_blocks,
    batch, heads_per_group, stats_rows, sm_scale, qk_scale,
    slope_scale, tanh_scale, softcap, ALIBI_SLOPES, stride_ab, stride_ah,   # score variants, else None
    window_left, window_right,                                              # a window, else None
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    DQ_BUFS: gl.constexpr, IS_CAUSAL: gl.constexpr,
    NUM_WG: gl.constexpr, WRITER_REGS_: gl.constexpr, PRODUCER_REGS_: gl.constexpr,
    CONSUMER_REGS_: gl.constexpr, DQ: gl.constexpr, SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False,
    HAS_LEFT: gl.constexpr = False, HAS_RIGHT: gl.constexpr = False, ATOMIC: gl.constexpr = False,
    TMA_DQ: gl.constexpr = False,
    CU_SEQLENS_Q=None, CU_SEQLENS_K=None, LSE2=None, DELTA=None, PACKED: gl.constexpr = False,  # packed
):
    """Grid: batch x KV heads x key blocks (``_bwd_coords``). PACKED: packed sequences (``Packed``;
    the descriptors over [1, total, H, D] views, seqlen_q / seqlen_k / num_m_blocks the longest
    sequence's, lse2 / delta [1, Hq, rows] also by pointer, LSE2 / DELTA); dK and dV only."""
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(DQ_BUFS >= 2, "the ordered writer takes two steps' partials per round")
    gl.static_assert(not (DQ and (HAS_LEFT or HAS_RIGHT)), "the fused form's dQ turns follow the causal walk")
    gl.static_assert(not (DQ and PACKED), "the fused form's dQ turns and workspace follow the dense layout")
    cfg = BwdConfig(HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_BUFS, IS_CAUSAL, NUM_WG, DQ, ATOMIC, TMA_DQ)
    work = BwdWork(num_n_blocks, num_heads_q, num_heads_k, kv_group_size, seqlen_q, seqlen_k, num_m_blocks, batch,
                   heads_per_group, stats_rows, Window(window_left, window_right, HAS_LEFT, HAS_RIGHT),
                   Packed(CU_SEQLENS_Q, CU_SEQLENS_K, PACKED))
    scores = ScoreArgs(slope_scale, tanh_scale, softcap, ALIBI_SLOPES, stride_ab, stride_ah, None, SOFTCAP, ALIBI,
                       False, HEAD_DIM)
    io = BwdIO(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV, DQW, SEM, stride_dkb, stride_dks,
               stride_dkh, stride_dvb, stride_dvs, stride_dvh, sm_scale, qk_scale, scores, LSE2, DELTA)
    kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    ds_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    if TMA_DQ:
        dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float32)
    else:
        dq_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_smem_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_smem_layout)
    if DQ:
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_smem_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS * NUM_WG, BLOCK_M, HEAD_DIM], dq_smem_layout)
    else:
        ds_smem = k_smem                     # placeholders: dK and dV only, nothing reads them
        dq_smem = k_smem
    row_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M], gl.float32)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=NUM_WG)      # every consumer partition releases
    for b in gl.static_range(DQ_BUFS):
        mbarrier.init(dq_full.index(b), count=NUM_WG)      # every consumer partition's partial
        mbarrier.init(dq_empty.index(b), count=1)
    sh = BwdShared(k_smem, v_smem, kv_ready, Ring(q_smem, q_ready, q_empty, STAGES), do_smem, lse_smem, delta_smem,
                   ds_smem, Ring(dq_smem, dq_full, dq_empty, DQ_BUFS))

    gl.static_assert(NUM_WG == 2, "two consumer partitions")
    if DQ:
        gl.warp_specialize([
            (_bwd_consumer, (cfg, 0, work, io, sh)),
            (_bwd_consumer, (cfg, 1, work, io, sh)),
            (_bwd_writer, (cfg, work, io, sh, 128)),
            (_bwd_producer, (cfg, work, io, sh)),
        ], [4, 4, 1], [CONSUMER_REGS_, WRITER_REGS_, PRODUCER_REGS_])
    else:
        gl.warp_specialize([
            (_bwd_consumer, (cfg, 0, work, io, sh)),
            (_bwd_consumer, (cfg, 1, work, io, sh)),
            (_bwd_producer, (cfg, work, io, sh)),
        ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])


@triton.jit
def _dq_finish_kernel(DQW, SEM, DQ, stride_dqb, stride_dqs, stride_dqh, num_heads_q, seqlen_q, num_m_blocks,
                      sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                      SEM_STRIDE_: tl.constexpr, ATOMIC_: tl.constexpr = False):
    """dq = sm_scale * workspace, in dq's dtype and strides; 0 where no key block added anything (the
    counter of the query block is still 0: its rows see no key). ATOMIC_: the workspace was zeroed
    and took atomic adds, no counters (SEM is not read)."""
    pid = tl.program_id(0)
    row_blocks = tl.cdiv(seqlen_q, ROWS)
    pid_r = pid % row_blocks
    bh = pid // row_blocks
    off_b = bh // num_heads_q
    off_h = bh % num_heads_q
    rows = pid_r * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    ok = rows < seqlen_q
    if ATOMIC_:
        reached = ok
    else:
        reached = tl.load(SEM + (bh * num_m_blocks + rows // BLOCK_M) * SEM_STRIDE_, mask=ok, other=0) > 0
    w = tl.load(DQW + (bh.to(tl.int64) * num_m_blocks * BLOCK_M + rows[:, None]) * HEAD_DIM + dims[None, :],
                mask=(ok & reached)[:, None], other=0.0)
    tl.store(DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
             + rows[:, None].to(tl.int64) * stride_dqs + dims[None, :],
             (w * sm_scale).to(DQ.dtype.element_ty), mask=ok[:, None])


# --------------------------------------------------------------------------------------------------
# dQ on the tensor cores (configurations with dq_kernel="gluon")
# --------------------------------------------------------------------------------------------------
# The dQ kernel of the dK/dV-only form, in the same style: a CTA keeps DQ_WG x 64 query rows of one
# (batch, query head) with their Q, dO, lse2 and delta, and walks the key blocks that those rows see,
# K and V streaming through a TMA ring (as the forward's). Per key block j each consumer warpgroup does
#     S = Q K_j^T    dP = dO V_j^T    P = exp2(S * scale * log2(e) - lse2)    dS = P * (dP - delta)
#     dQ += dS K_j   (dS from registers; dQ in registers for the whole CTA)
# and at the end stores dQ * sm_scale. Three tile products per pair, like the Triton dQ kernel.

DQ_WG = 2          # consumer warpgroups of the dQ kernel, 64 query rows each
DQ_ROWS = 64
assert STATS_TILE % (DQ_WG * DQ_ROWS) == 0


@aggregate
class DqConfig:
    """The compile-time configuration of a dQ launch."""
    ROWS: gl.constexpr
    NUM_WG: gl.constexpr
    BLOCK_N: gl.constexpr
    HEAD_DIM: gl.constexpr
    STAGES: gl.constexpr
    IS_CAUSAL: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ROWS, NUM_WG, BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL):
        constexprs(self, ROWS=ROWS, NUM_WG=NUM_WG, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, STAGES=STAGES,
                   IS_CAUSAL=IS_CAUSAL)


@aggregate
class DqWork:
    """The problem's sizes: every partition derives its tile and key blocks from them (``coords``).
    ``packed``: the sequences' layout (``sm90_common.Packed``), as the forward's."""
    num_heads_q: SCALAR
    kv_group_size: SCALAR
    seqlen_q: SCALAR
    seqlen_k: SCALAR
    num_m_blocks: SCALAR
    stats_rows: SCALAR
    window: Window
    packed: Packed

    @gluon.constexpr_function
    def __init__(self, num_heads_q, kv_group_size, seqlen_q, seqlen_k, num_m_blocks, stats_rows, window, packed):
        constexprs(self, num_heads_q=num_heads_q, kv_group_size=kv_group_size, seqlen_q=seqlen_q,
                   seqlen_k=seqlen_k, num_m_blocks=num_m_blocks, stats_rows=stats_rows)
        self.window = window
        self.packed = packed

    @gluon.jit
    def coords(self, cfg):
        """The forward's tile walk (``Tiles.walk``) for this program's tile, one per program in the
        PLAIN order: (pid_bh, batch, query head, kv head, first query row, first and end key block,
        valid, q0, k0, seqlen_q, seqlen_k); packed, a tile past its sequence's end is not valid."""
        tiles = Tiles(gl.num_programs(0), 1, self.num_m_blocks, self.num_heads_q, self.kv_group_size, self.seqlen_q,
                      self.seqlen_k, self.window, self.packed, cfg.ROWS * cfg.NUM_WG, cfg.BLOCK_N, cfg.IS_CAUSAL,
                      PLAIN)
        return tiles.walk(gl.program_id(0), 0)

    @gluon.jit
    def stats_row(self, pid_bh, off_h, row):
        """Where query row ``row`` of (batch, head) pid_bh lies in the flat lse2 / delta buffers:
        [B, Hq, stats_rows] dense, [1, Hq, total_q] packed (``row`` counts from the packed tensors'
        first row)."""
        if self.packed.ON:
            return off_h * self.stats_rows + row
        else:
            return pid_bh * self.stats_rows + row


@aggregate
class DqShared:
    """The query side of the tile (one slot per consumer warpgroup, all behind ``q_ready``) and the K/V
    ring (``kv``: the K tiles and their barriers; ``v`` shares its slots)."""
    q: SMEM
    do: SMEM
    lse: SMEM
    delta: SMEM
    q_ready: SMEM
    kv: Ring
    v: SMEM

    @gluon.constexpr_function
    def __init__(self, q, do, lse, delta, q_ready, kv, v):
        constexprs(self, q=q, do=do, lse=lse, delta=delta, q_ready=q_ready, kv=kv, v=v)


@aggregate
class DqIO:
    """Q, K, V, dO, lse2 and delta through TMA descriptors (packed: lse2 and delta by pointer, LSE2 /
    DELTA); dQ by pointer and strides; the scales and the score variants, as ``BwdIO``'s."""
    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    do_desc: tma.tensor_descriptor
    lse_desc: tma.tensor_descriptor
    delta_desc: tma.tensor_descriptor
    DQ: gl.tensor
    stride_dqb: SCALAR
    stride_dqs: SCALAR
    stride_dqh: SCALAR
    sm_scale: gl.tensor
    qk_scale: gl.tensor
    scores: ScoreArgs
    LSE2: SCALAR
    DELTA: SCALAR

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DQ, stride_dqb, stride_dqs,
                 stride_dqh, sm_scale, qk_scale, scores, LSE2=None, DELTA=None):
        constexprs(self, q_desc=q_desc, k_desc=k_desc, v_desc=v_desc, do_desc=do_desc, lse_desc=lse_desc,
                   delta_desc=delta_desc, DQ=DQ, stride_dqb=stride_dqb, stride_dqs=stride_dqs, stride_dqh=stride_dqh,
                   sm_scale=sm_scale, qk_scale=qk_scale, LSE2=LSE2, DELTA=DELTA)
        self.scores = scores


@gluon.jit
def _dq_producer(cfg, work, io, sh):
    """The query side once (one barrier for all of it; packed, lse2 and delta by ``_load_stats`` before
    it is armed), then K_j and V_j into ring slot j % STAGES. The tile and its key blocks are the
    forward's (``Tiles.walk``: every key block some row of the tile sees; causal, one head after the
    other, the heaviest query blocks first)."""
    ROWS: gl.constexpr = cfg.ROWS
    NUM_WG: gl.constexpr = cfg.NUM_WG
    pid_bh, off_b, off_h, off_hk, start_m, first, n_blocks, valid, q0, k0, seqlen_q, _ = work.coords(cfg)
    desc_b = work.packed.batch_index(off_b)
    if valid:
        if work.packed.ON:
            for w in gl.static_range(NUM_WG):
                row = work.stats_row(pid_bh, off_h, q0 + start_m + w * ROWS)
                _load_stats(io, sh.lse.index(w), sh.delta.index(w), row, seqlen_q - (start_m + w * ROWS), ROWS)
            mbarrier.expect(sh.q_ready, NUM_WG * (io.q_desc.block_type.nbytes + io.do_desc.block_type.nbytes))
        else:
            mbarrier.expect(sh.q_ready, NUM_WG * (io.q_desc.block_type.nbytes + io.do_desc.block_type.nbytes
                                                  + 2 * io.lse_desc.block_type.nbytes))
        for w in gl.static_range(NUM_WG):
            row0 = q0 + start_m + w * ROWS
            tma.async_copy_global_to_shared(io.q_desc, [desc_b, row0, off_h, 0], sh.q_ready, sh.q.index(w))
            tma.async_copy_global_to_shared(io.do_desc, [desc_b, row0, off_h, 0], sh.q_ready, sh.do.index(w))
            if not work.packed.ON:
                row = work.stats_row(pid_bh, off_h, row0)
                tma.async_copy_global_to_shared(io.lse_desc, [row], sh.q_ready, sh.lse.index(w))
                tma.async_copy_global_to_shared(io.delta_desc, [row], sh.q_ready, sh.delta.index(w))
        for j in range(first, n_blocks):
            s = sh.kv.index(j - first)
            sh.kv.acquire(j - first)
            sh.kv.expect(s, io.k_desc.block_type.nbytes + io.v_desc.block_type.nbytes)
            sh.kv.load(io.k_desc, [desc_b, k0 + j * cfg.BLOCK_N, off_hk, 0], s)
            tma.async_copy_global_to_shared(io.v_desc, [desc_b, k0 + j * cfg.BLOCK_N, off_hk, 0],
                                            sh.kv.ready.index(s), sh.v.index(s))


@gluon.jit
def _dq_step(cfg, sh, j, c, dq, q_tile, do_tile, zero_s, lse2, delta, cols0, col_limit, qk_scale,
             a_layout: gl.constexpr, MASK: gl.constexpr, mod, col_start=None, k_end=None,
             ld_layout: gl.constexpr = None):
    """One key block j (ring tile c) of the dQ consumer: S, dP, dS = P (dP - delta), dQ += dS K_j.
    MASK: keys at or past a row's column limit (its causal diagonal + 1, a window's right edge, or
    seqlen_k) and, with ``col_start``, before a window's left edge get p = 0. ``mod``: the tile's
    ``Scores`` (softcap, ALiBi; softcap's factor on dS). ``k_end`` (packed sequences, masked steps:
    the sequence's seqlen_k): K and V rows from k_end on are the next sequence's, zeroed in the slot
    before the products (``zero_rows_past``, in ``ld_layout``), so that p = 0 there meets zeros, not NaN."""
    dtype: gl.constexpr = q_tile.dtype
    s = sh.kv.index(c)
    sh.kv.wait(c)
    k_tile = sh.kv.tile(s)
    if k_end is not None:
        # Both consumer partitions zero the slot's rows (the same values), each before its products.
        zero_rows_past(k_tile, j, k_end, cfg.BLOCK_N, ld_layout, sh.v.index(s))
    s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do_tile, sh.v.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s_ij = warpgroup_mma_wait(1, deps=(s_tok,))
    if mod.SOFTCAP or mod.ALIBI:
        s_ij, g = mod.apply_grad(s_ij, j * cfg.BLOCK_N + cols0)
    p = gl.exp2(s_ij * qk_scale - lse2[:, None])
    if MASK:
        cols = j * cfg.BLOCK_N + cols0
        p = gl.where(seen_cols(cols, col_limit, col_start), p, 0.0)
    dp = warpgroup_mma_wait(0, deps=(dp_tok,))
    if mod.SOFTCAP:
        ds = gl.convert_layout((p * (dp - delta[:, None]) * g).to(dtype), a_layout)
    else:
        ds = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), a_layout)
    dq_tok = warpgroup_mma(ds, k_tile, dq, is_async=True)
    dq, ds = warpgroup_mma_wait(0, deps=(dq_tok, ds))
    sh.kv.release(s, True)               # after every warp of the partition is past its wait
    return dq


@gluon.jit
def _dq_consumer(cfg, WG: gl.constexpr, work, io, sh):
    """Query rows [start_m + WG * ROWS, + ROWS) of the program's tile, if it is valid (``_dq_rows``)."""
    pid_bh, off_b, off_h, off_hk, start_m, first, n_blocks, valid, q0, k0, seqlen_q, seqlen_k = work.coords(cfg)
    if valid:
        _dq_rows(cfg, WG, work, io, sh, pid_bh, off_b, off_h, start_m, first, n_blocks, q0, seqlen_q, seqlen_k)


@gluon.jit
def _dq_rows(cfg, WG: gl.constexpr, work, io, sh, pid_bh, off_b, off_h, start_m, first, n_blocks, q0, seqlen_q,
             seqlen_k):
    """Query rows [start_m + WG * ROWS, + ROWS) of the sequence from row q0: dQ over every key block of
    the tile. Rows past seqlen_q (zero Q and dO, lse2 = +inf; packed, the next sequence's rows, never
    stored) and rows that see no key (lse2 = +inf) get p = 0; key rows past seqlen_k and keys after a
    row's causal diagonal are masked to p = 0 (their zero K rows would otherwise give p = exp2(-lse2),
    see _bwd_step)."""
    ROWS: gl.constexpr = cfg.ROWS
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    # Packed sequences: the masked steps zero the K and V rows past the sequence's keys (``k_end``).
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
    if work.packed.ON:
        k_end = seqlen_k
    else:
        k_end = None
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    row0 = start_m + WG * ROWS
    rows = row0 + gl.arange(0, ROWS, layout=row_layout)
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    causal_offset = seqlen_k - seqlen_q
    # Key blocks [full_lo, n_full) are seen in full by every row of this warpgroup: no mask there
    # (full_lo = 0 without a window); row i sees keys [col_start[i], col_limit[i]).
    col_start = None
    if work.window.ON:
        full_lo, n_full, col_limit = work.window.row_limits(row0, rows, causal_offset, seqlen_k, ROWS, BLOCK_N)
        if work.window.HAS_LEFT:
            col_start = work.window.col_start(rows, causal_offset)
    else:
        n_full, col_limit = row_limits(row0, rows, causal_offset, seqlen_k, ROWS, BLOCK_N, cfg.IS_CAUSAL,
                                        row_layout)
    q_tile = sh.q.index(WG)
    do_tile = sh.do.index(WG)
    mbarrier.wait(sh.q_ready, 0)
    lse2 = sh.lse.index(WG).load(row_layout)
    delta = sh.delta.index(WG).load(row_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, dq_layout)
    mod = io.scores.tile(off_b, off_h, rows, causal_offset)         # score variants (else a no-op)
    # Key blocks [lo, n_lo) unmasked, then the rest masked, in loops of their own (no branch inside a
    # step); with a window, masked blocks [first, lo) before them.
    n_lo = gl.minimum(n_full, n_blocks)
    lo = first
    if work.window.ON:
        n_lo = gl.maximum(n_lo, first)
        lo = gl.minimum(gl.maximum(full_lo, first), n_lo)
        for j in range(first, lo):
            dq = _dq_step(cfg, sh, j, j - first, dq, q_tile, do_tile, zero_s, lse2, delta, cols0, col_limit,
                          io.qk_scale, a_layout, True, mod, col_start, k_end, ld_layout)
    for j in range(lo, n_lo):
        dq = _dq_step(cfg, sh, j, j - first, dq, q_tile, do_tile, zero_s, lse2, delta, cols0, col_limit, io.qk_scale,
                      a_layout, False, mod)
    for j in range(n_lo, n_blocks):
        dq = _dq_step(cfg, sh, j, j - first, dq, q_tile, do_tile, zero_s, lse2, delta, cols0, col_limit, io.qk_scale,
                      a_layout, True, mod, col_start, k_end, ld_layout)
    out_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, dq_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
    if work.packed.ON:                   # [1, total_q, Hq, D]: the sequence's rows from q0
        ptrs = io.DQ + off_h.to(gl.int64) * io.stride_dqh + (q0 + out_rows)[:, None].to(gl.int64) * io.stride_dqs \
            + dims[None, :]
    else:
        ptrs = io.DQ + off_b.to(gl.int64) * io.stride_dqb + off_h.to(gl.int64) * io.stride_dqh \
            + out_rows[:, None].to(gl.int64) * io.stride_dqs + dims[None, :]
    gl.store(ptrs, (dq * io.sm_scale).to(io.DQ.dtype.element_ty), mask=(out_rows < seqlen_q)[:, None])


@gluon.jit(do_not_specialize=["num_heads_q", "kv_group_size", "seqlen_q", "seqlen_k", "num_m_blocks",
                              "window_left", "window_right"])
def _attn_bwd_dq_hopper_kernel(
    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DQ,
    stride_dqb, stride_dqs, stride_dqh,
    num_heads_q, kv_group_size, seqlen_q, seqlen_k, num_m_blocks, stats_rows, sm_scale, qk_scale,
    slope_scale, tanh_scale, softcap, ALIBI_SLOPES, stride_ab, stride_ah,   # score variants, else None
    window_left, window_right,                                              # a window, else None
    HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, NUM_WG: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, PRODUCER_REGS_: gl.constexpr, CONSUMER_REGS_: gl.constexpr,
    SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False,
    HAS_LEFT: gl.constexpr = False, HAS_RIGHT: gl.constexpr = False,
    CU_SEQLENS_Q=None, CU_SEQLENS_K=None, LSE2=None, DELTA=None, PACKED: gl.constexpr = False,  # packed
):
    """Grid: one program per query tile (``DqWork.coords``). PACKED: packed sequences (``Packed``),
    as ``_attn_bwd_hopper_kernel``'s."""
    dtype: gl.constexpr = q_desc.dtype
    cfg = DqConfig(ROWS, NUM_WG, BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL)
    work = DqWork(num_heads_q, kv_group_size, seqlen_q, seqlen_k, num_m_blocks, stats_rows,
                  Window(window_left, window_right, HAS_LEFT, HAS_RIGHT), Packed(CU_SEQLENS_Q, CU_SEQLENS_K, PACKED))
    scores = ScoreArgs(slope_scale, tanh_scale, softcap, ALIBI_SLOPES, stride_ab, stride_ah, None, SOFTCAP, ALIBI,
                       False, HEAD_DIM)
    io = DqIO(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DQ, stride_dqb, stride_dqs, stride_dqh,
              sm_scale, qk_scale, scores, LSE2, DELTA)
    kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    row_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS], gl.float32)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, ROWS, HEAD_DIM], q_smem_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_WG, ROWS, HEAD_DIM], q_smem_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_smem_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_WG, ROWS], row_smem_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_WG, ROWS], row_smem_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=NUM_WG)     # every consumer warpgroup releases
    sh = DqShared(q_smem, do_smem, lse_smem, delta_smem, q_ready, Ring(k_smem, kv_ready, kv_empty, STAGES), v_smem)
    gl.static_assert(NUM_WG == 2, "two consumer partitions")
    gl.warp_specialize([
        (_dq_consumer, (cfg, 0, work, io, sh)),
        (_dq_consumer, (cfg, 1, work, io, sh)),
        (_dq_producer, (cfg, work, io, sh)),
    ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------

def _row_descriptor(t: torch.Tensor, rows: int) -> GluonTensorDescriptor:
    """1-D descriptor over a contiguous float32 tensor, moving boxes of ``rows`` entries."""
    flat = t.view(-1)
    desc = object.__new__(GluonTensorDescriptor)
    desc.base, desc.shape, desc.strides = flat, [flat.numel()], [1]
    desc.block_shape, desc.padding = [rows], "zero"
    desc.layout = shared_layout((rows,), gl.float32)
    return desc


def _workspace_descriptor(work: torch.Tensor, rows: int) -> GluonTensorDescriptor:
    """3-D descriptor over the fp32 dQ workspace [B, Hq, R, D] as [B * Hq, R, D], moving [1, rows, D]
    boxes (one step's tile), for the writer's TMA reduce-adds."""
    b, h, r, d = work.shape
    desc = object.__new__(GluonTensorDescriptor)
    desc.base, desc.shape, desc.strides = work, [b * h, r, d], [r * d, d, 1]
    desc.block_shape, desc.padding = [1, rows, d], "zero"
    desc.layout = shared_layout((1, rows, d), gl.float32)
    return desc


def _check_stats(lse2, delta, rows_q: int, packed: dict):
    """Checks lse2 / delta against the rows the kernels read (``padded_rows`` of ``rows_q``: the query
    length, packed the total) and, for packed sequences, adds them to the launch's ``packed``
    arguments (``LSE2`` / ``DELTA``: the producers load them by pointer, ``_load_stats``)."""
    rows = padded_rows(rows_q, packed=bool(packed))
    if (lse2.shape[-1] != rows or delta.shape != lse2.shape or not lse2.is_contiguous()
            or not delta.is_contiguous() or lse2.data_ptr() % 16 or delta.data_ptr() % 16):
        raise ValueError(f"lse2 / delta must be contiguous, 16-byte aligned [B, Hq, {rows}] (padded_rows); got "
                         f"lse2 {tuple(lse2.shape)}, delta {tuple(delta.shape)}")
    if packed:
        packed.update(LSE2=lse2, DELTA=delta)


def supported(q, k, v, dout, variant: str) -> bool:
    """The forward Hopper kernel's conditions (sm90_common.tma_supported: CUDA fp16/bf16 [B, S, H, D]
    views, GQA, TMA-compatible strides; dout checked like its output) and a head dim the variant has a
    config for, on an sm_90 GPU. Packed sequences: ask with [1, total, H, D] views."""
    return (q.shape[-1] in VARIANTS[variant] and tma_supported(q, k, v, dout)
            and gluon_hopper_applies(head_dim=q.shape[-1], dtype=q.dtype, device=q.device))


@on_input_device
def backward_hopper(dout, q, k, v, lse2, delta, sm_scale: float, causal: bool, dq, dk, dv, *,
                    variant: str = "split", scores: ScoreVariant = NO_SCORES,
                    window: tuple[int, int] | None = None, varlen: Varlen | None = None):
    """Fill dq, dk, dv ([B, S, H, D] views, last stride 1) from dout and the preprocess kernel's lse2
    (base-2 LSE, +inf for rows without keys) and delta ([B, Hq, padded_rows] float32). A variant
    without dQ (``computes_dq``) fills dk and dv only and leaves dq (which may be None) alone.
    ``scores``: the forward's score variants (softcap and ALiBi change P and dS; sinks need nothing).
    ``window``: as ``block_ranges.window_bounds`` returns it, or None; the dK/dV-only variants only.
    ``varlen``: packed sequences (``common.Varlen``), the dK/dV-only variants only: q / dout
    [total_q, Hq, D], k / v / dk / dv [total_k, Hkv, D], lse2 / delta [1, Hq, padded_rows(total_q,
    packed=True)]."""
    cfg = variant_config(variant, q.shape[-1])
    if window is not None and cfg["dq"]:
        raise ValueError(f"variant {variant!r} (dQ in the same pass) takes no window; got window={window}")
    if varlen is not None and cfg["dq"]:
        raise ValueError(f"variant {variant!r} (dQ in the same pass) takes no packed sequences; got varlen")
    batch, seqlen_q, seqlen_k, (q, k, v, dout, dk, dv), packed = sequences(varlen, q, k, v, dout, dk, dv)
    heads_q, head_dim = q.shape[2:]
    heads_k = k.shape[2]
    block_m = cfg["block_m"]
    num_m_blocks = cdiv(seqlen_q, block_m)
    num_n_blocks = cdiv(seqlen_k, BLOCK_N)
    if cfg["dq"] and cfg["atomic"]:
        dq_work = torch.zeros((batch, heads_q, num_m_blocks * block_m, head_dim), dtype=torch.float32,
                              device=q.device)
        sem = dq_work                        # not read: no turns
    elif cfg["dq"]:
        dq_work = torch.empty((batch, heads_q, num_m_blocks * block_m, head_dim), dtype=torch.float32,
                              device=q.device)
        sem = torch.zeros((batch, heads_q, num_m_blocks, int(SEM_STRIDE)), dtype=torch.int32,
                          device=q.device)
    else:
        dq_work, sem = lse2, delta           # not read without the writer
    _check_stats(lse2, delta, q.shape[1], packed)
    if batch * heads_k * num_n_blocks == 0:
        return dq, dk, dv                    # packed: no sequence has a key (dk, dv are empty)
    # The writer adds dQ by pointer, or with TMA_DQ through a descriptor over the workspace.
    dqw_arg = _workspace_descriptor(dq_work, block_m) if cfg["tma_dq"] else dq_work
    lse_desc = _row_descriptor(lse2, block_m)
    delta_desc = _row_descriptor(delta, block_m)
    # About one wave of CTAs per group of (batch, KV head) pairs (see _bwd_coords).
    sms = sm_count(q.device) if q.is_cuda else 132
    heads_per_group = max(1, sms // num_n_blocks)
    q_desc = descriptor(q, block_m, head_dim)
    do_desc = descriptor(dout, block_m, head_dim)
    k_desc = descriptor(k, BLOCK_N, head_dim)
    v_desc = descriptor(v, BLOCK_N, head_dim)
    launch.run(
        _attn_bwd_hopper_kernel, (batch * heads_k * num_n_blocks,),
        q_desc=q_desc, k_desc=k_desc, v_desc=v_desc, do_desc=do_desc, lse_desc=lse_desc, delta_desc=delta_desc,
        DK=dk, DV=dv, DQW=dqw_arg, SEM=sem,
        stride_dkb=dk.stride(0), stride_dks=dk.stride(1), stride_dkh=dk.stride(2),
        stride_dvb=dv.stride(0), stride_dvs=dv.stride(1), stride_dvh=dv.stride(2),
        num_n_blocks=num_n_blocks, num_heads_q=heads_q, num_heads_k=heads_k, kv_group_size=heads_q // heads_k,
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_m_blocks=num_m_blocks, batch=batch,
        heads_per_group=heads_per_group, stats_rows=lse2.shape[-1], sm_scale=sm_scale,
        **score_launch_args(scores, sm_scale, sinks=False), **window_kernel_args(window), **packed,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=BLOCK_N, STAGES=cfg["stages"], DQ_BUFS=cfg["dq_bufs"],
        IS_CAUSAL=causal, NUM_WG=NUM_WG,
        WRITER_REGS_=cfg["writer_regs"], PRODUCER_REGS_=PRODUCER_REGS, CONSUMER_REGS_=cfg["consumer_regs"],
        DQ=cfg["dq"], ATOMIC=cfg["atomic"], TMA_DQ=cfg["tma_dq"], num_warps=cfg["num_warps"],
        maxnreg=cfg["maxnreg"],
    )
    if not cfg["dq"]:
        return dq, dk, dv
    rows = 32
    launch.run(
        _dq_finish_kernel, (batch * heads_q * cdiv(seqlen_q, rows),),
        DQW=dq_work, SEM=sem, DQ=dq, stride_dqb=dq.stride(0), stride_dqs=dq.stride(1), stride_dqh=dq.stride(2),
        num_heads_q=heads_q, seqlen_q=seqlen_q, num_m_blocks=num_m_blocks, sm_scale=sm_scale,
        HEAD_DIM=head_dim, BLOCK_M=block_m, ROWS=rows, SEM_STRIDE_=int(SEM_STRIDE), ATOMIC_=cfg["atomic"],
        num_warps=4,
    )
    return dq, dk, dv


def dq_on_gluon(variant: str, head_dim: int) -> bool:
    """Whether a dK/dV-only variant takes its dQ from this file's dQ kernel at this head dim (else
    from the Triton one)."""
    return VARIANTS[variant][head_dim].get("dq_kernel") == "gluon"


@on_input_device
def dq_hopper(dout, q, k, v, lse2, delta, sm_scale: float, causal: bool, dq, *, variant: str,
              scores: ScoreVariant = NO_SCORES, window: tuple[int, int] | None = None,
              varlen: Varlen | None = None):
    """Fill dq ([B, Sq, Hq, D], last stride 1) with the Gluon dQ kernel, from the preprocess
    kernel's lse2 and delta (padded_rows rows per head); ``scores``, ``window`` and ``varlen`` as
    ``backward_hopper``'s."""
    batch, seqlen_q, seqlen_k, (q, k, v, dout, dq_4d), packed = sequences(varlen, q, k, v, dout, dq)
    heads_q, head_dim = q.shape[2:]
    heads_k = k.shape[2]
    cfg = VARIANTS[variant][head_dim]
    block_n, stages, rows = cfg["dq_block_n"], cfg["dq_stages"], DQ_ROWS
    num_m_blocks = cdiv(seqlen_q, rows * DQ_WG)
    _check_stats(lse2, delta, q.shape[1], packed)
    if batch * heads_q * num_m_blocks == 0:
        return dq                            # packed: no sequence has a query (dq is empty)
    launch.run(
        _attn_bwd_dq_hopper_kernel, (batch * heads_q * num_m_blocks,),
        q_desc=descriptor(q, rows, head_dim), k_desc=descriptor(k, block_n, head_dim),
        v_desc=descriptor(v, block_n, head_dim), do_desc=descriptor(dout, rows, head_dim),
        lse_desc=_row_descriptor(lse2, rows), delta_desc=_row_descriptor(delta, rows), DQ=dq_4d,
        stride_dqb=dq_4d.stride(0), stride_dqs=dq_4d.stride(1), stride_dqh=dq_4d.stride(2),
        num_heads_q=heads_q, kv_group_size=heads_q // heads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        num_m_blocks=num_m_blocks, stats_rows=lse2.shape[-1], sm_scale=sm_scale,
        **score_launch_args(scores, sm_scale, sinks=False), **window_kernel_args(window), **packed,
        HEAD_DIM=head_dim, ROWS=rows, NUM_WG=DQ_WG, BLOCK_N=block_n, STAGES=stages, IS_CAUSAL=causal,
        PRODUCER_REGS_=PRODUCER_REGS, CONSUMER_REGS_=CONSUMER_REGS_3WG,
        num_warps=4, maxnreg=MAXNREG_3WG,
    )
    return dq
