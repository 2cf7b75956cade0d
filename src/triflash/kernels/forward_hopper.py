"""FlashAttention forward for Hopper (sm_90) in Gluon: warp-specialized, TMA-fed, async wgmma.

What this adds over the plain Triton forward (forward.py), and why
-------------------------------------------------------------------
The plain kernel leaves the scheduling to the compiler: every warp loads, multiplies and does
softmax in turn. On Hopper the tensor cores (wgmma) and the TMA copy engine are asynchronous, so the
fastest kernels (FlashAttention-3) schedule by hand:

1. *Warp specialization.* The CTA's warps are split into partitions that run different code:

   * a **producer** (one warp, ``_producer``): issues TMA copies only. It loads the query tile(s)
     once, then streams K and V tiles into a ring of ``STAGES`` shared-memory slots. It needs almost
     no registers, so it gives its registers away (``worker_num_regs``: Hopper's ``setmaxnreg``
     shrinks the producer's warpgroup to 24 registers per thread and grows the consumers').
   * one or two **consumers** (a warpgroup of 4 warps each, ``_consumer``): compute
     S = Q K^T with wgmma, the online softmax in registers, and O += P V with wgmma; then the
     epilogue (O / l and the LSE) and the TMA store of O.

2. *mbarriers* connect them. Each slot s of the ring has four barriers in shared memory:

   * ``k_ready[s]`` / ``v_ready[s]`` (count 1): the producer arms them with ``mbarrier.expect`` (the
     byte count of one tile, which TMA always transfers in full, zero-filling rows past the end),
     and the TMA engine completes them when the bytes have landed.
   * ``k_empty[s]`` / ``v_empty[s]`` (count = number of consumer warpgroups): each consumer arrives
     once it has finished *reading* the slot (its wgmma has completed), so the producer may refill it.

   A barrier's phase flips each time it completes; waiters pass the parity they expect. The k-th use
   of slot s (key block j = k * STAGES + s) waits for parity k & 1 on the ready barriers; the producer
   waits for parity (k & 1) ^ 1 on the empty barriers, which a freshly initialised barrier already
   satisfies (so the first STAGES tiles need no consumer release).

   The producer and the consumers walk exactly the same key blocks [0, n_blocks), computed once
   before the partitions fork, so every wait has its matching arrive; with n_blocks = 0 (query rows
   above the causal diagonal of a shorter key sequence) no K/V barrier is touched at all.

3. *Intra-warpgroup overlap* (OVERLAP): a consumer issues the wgmma of S_j = Q K_j^T and of
   O += P_{j-1} V_{j-1} back to back (both asynchronous), waits only for S_j (``warpgroup_mma_wait(1)``:
   at most one group, the PV one, still in flight), and computes the softmax of S_j while the tensor
   cores still run P_{j-1} V_{j-1}. Only then does it wait for the PV product and rescale O by
   alpha_j = exp(m_{j-1} - m_j). (That order is exact: O_j = alpha_j * (O_{j-1} + P_{j-1} V_{j-1}).)

4. *Ping-pong between two consumer warpgroups* (PINGPONG): the CTA owns 2 x 64 query rows, one
   warpgroup each, both reading the same K/V slots. Two more mbarriers, ``sched[0]`` and ``sched[1]``,
   pass a token: a warpgroup waits for its turn before issuing its wgmmas of one step and hands the
   turn over right after issuing them. So the GEMMs of one warpgroup run while the other does its
   softmax (the exp2 unit and the tensor cores are busy at the same time). Turns strictly alternate:
   warpgroup 0 issues step t after warpgroup 1 issued step t - 1, and warpgroup 1 issues step t
   after warpgroup 0 issued step t.

   Without ping-pong (PINGPONG = False) one warpgroup of 4 warps owns 64 rows, or (CONSUMER_WARPS = 8)
   two warpgroups run the same code on 128 rows as one partition (the compiler's wgmma then spans
   both warpgroups); there a thread barrier before each release makes sure *both* warpgroups are done
   with a slot, because wgmma waits are per warpgroup and the release is a single arrive.

Numerics are those of forward.py: fp32 online-softmax state (m in raw score units, l, O), base-2
exponentials with qk_scale = sm_scale * log2(e) folded into one FMA with the row max, masked scores
set to -inf, rows that see no key give out = 0 and lse = -inf, LSE = m * sm_scale + ln(l) (natural
log). Key blocks wholly above the causal diagonal are never loaded; key blocks that every row of a
warpgroup sees in full skip the mask; causal programs start with the heaviest query blocks.

Shapes and layouts: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], any strides with unit stride on D that
TMA accepts (``tma_compatible``), read through host-built 4-D descriptors moving [1, rows, 1, D]
boxes of one (batch, head). The shared-memory tiles are 2-D [rows, D] with 128-byte swizzle (the
same bytes as the 4-D box), which is the operand layout wgmma reads: K is used transposed through a
permuted view (wgmma transposes 16-bit B operands for free), P goes in registers as the A operand.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

from .common import LOG2E, on_input_device
from .forward import tma_compatible

# --------------------------------------------------------------------------------------------------
# Variants: one GPU run times them all. name -> (head_dim -> config dict)
# --------------------------------------------------------------------------------------------------
#   block_n: keys per tile; stages: K/V ring depth; overlap: intra-warpgroup S/PV overlap;
#   pingpong: two consumer warpgroups with turn-taking (64 rows each, 128 per CTA);
#   consumer_warps: warps of a non-ping-pong consumer (4: 64 rows, 8: 128 rows);
#   maxnreg: per-thread register limit of the launch (the consumer gets what the producer gives up).

# Shared memory per CTA (fp16/bf16): Q 128*D*2 + stages * 2 * BN*D*2 (+ barriers, epilogue reuses Q).
#   D=128, BN=128: 32 KiB + stages * 64 KiB -> 2 stages = 160 KiB; D=64, BN=128: 16 + stages * 32.
VARIANTS = {
    # FA3's schedule: producer warp + two consumer warpgroups in ping-pong, intra-warpgroup overlap.
    "pp": {64: dict(block_n=128, stages=3, overlap=True, pingpong=True, consumer_warps=4),
           128: dict(block_n=128, stages=2, overlap=True, pingpong=True, consumer_warps=4)},
    # Same without the ping-pong token (the warp scheduler interleaves the two warpgroups freely).
    "ws2": {64: dict(block_n=128, stages=3, overlap=True, pingpong=False, consumer_warps=8),
            128: dict(block_n=128, stages=2, overlap=True, pingpong=False, consumer_warps=8)},
    # Ping-pong with 64-key tiles: smaller register footprint, deeper ring.
    "pp_n64": {64: dict(block_n=64, stages=4, overlap=True, pingpong=True, consumer_warps=4),
               128: dict(block_n=64, stages=3, overlap=True, pingpong=True, consumer_warps=4)},
    # The conservative one: one warpgroup, no overlap (load/compute overlap via the producer only).
    # Two CTAs per SM (maxnreg 128: 8 warps x 128 registers x 2 = 64K), so two CTAs' softmax and
    # GEMMs interleave through the warp scheduler.
    "safe": {64: dict(block_n=128, stages=2, overlap=False, pingpong=False, consumer_warps=4, maxnreg=128),
             128: dict(block_n=64, stages=2, overlap=False, pingpong=False, consumer_warps=4, maxnreg=128)},
}
DEFAULT_VARIANT = "pp"

PRODUCER_REGS = 24          # setmaxnreg of the producer's warpgroup (the minimum)
CONSUMER_REGS = 240         # setmaxnreg of a consumer warpgroup running as a worker partition


def variant_config(variant: str | None, head_dim: int) -> dict:
    cfg = dict(VARIANTS[variant or DEFAULT_VARIANT][head_dim])
    warps = 4 if cfg["pingpong"] else cfg["consumer_warps"]
    cfg["rows"] = 16 * warps                              # query rows of one consumer partition
    cfg["block_m"] = cfg["rows"] * (2 if cfg["pingpong"] else 1)
    cfg["num_warps"] = warps                              # the default partition's warps
    # Warps of the launch, counted in whole warpgroups (registers are reallocated per warpgroup):
    # consumers + the producer's warpgroup. maxnreg * threads must fit the 64K-register file.
    total_warps = (8 if cfg["pingpong"] else warps) + 4
    cfg.setdefault("maxnreg", min(256, (65536 // (32 * total_warps)) // 8 * 8))
    return cfg


# --------------------------------------------------------------------------------------------------
# Partitions
# --------------------------------------------------------------------------------------------------

@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem,
              q_bars, k_ready, k_empty, v_ready, v_empty,
              off_b, off_h, off_hk, start_m, n_blocks,
              ROWS: gl.constexpr, NUM_WG: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: TMA loads of the query tile(s), then K_j and V_j for j in [0, n_blocks)."""
    for w in gl.static_range(NUM_WG):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, start_m + w * ROWS, off_h, 0], q_bars.index(w),
                                        q_smem.index(w))
    for j in range(n_blocks):
        s = j % STAGES
        empty_phase = ((j // STAGES) & 1) ^ 1        # a fresh barrier passes parity 1 at once
        start_n = j * BLOCK_N
        # K first: the consumers need K_j (for S_j) before V_j (for the PV product one step later).
        mbarrier.wait(k_empty.index(s), empty_phase)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [off_b, start_n, off_hk, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), empty_phase)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [off_b, start_n, off_hk, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _turn_begin(sched, t, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until this warpgroup may issue the wgmmas of step t. Warpgroup 0 goes first
    (step 0 needs no token); afterwards each waits for the other's hand-over of the previous turn."""
    if PINGPONG:
        if WG == 0:
            mbarrier.wait(sched.index(0), (t + 1) & 1, pred=t > 0)     # t-th token from WG 1: t-1'th phase
        else:
            mbarrier.wait(sched.index(1), t & 1)


@gluon.jit
def _turn_end(sched, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: this warpgroup's wgmmas of the step are issued; hand the turn to the other one."""
    if PINGPONG:
        mbarrier.arrive(sched.index(1 - WG), count=1)


@gluon.jit
def _release(bar, SYNC: gl.constexpr):
    """Signal the producer that a K or V slot has been read. SYNC (a consumer of two warpgroups in one
    partition): wgmma waits are per warpgroup and the arrive is done once, so first make sure every
    warp of the partition is past its wait."""
    if SYNC:
        gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _softmax(s, m_i, l_i, col_limit, cols, qk_scale, MASK: gl.constexpr):
    """Fold one tile of raw scores s [ROWS, BN] into the running (m, l). Returns (p fp32, m_new,
    l_new, alpha). MASK: scores at columns >= col_limit (a per-row bound: the end of the keys or the
    causal diagonal) become -inf. Rows that have seen no key keep m = -inf, l = 0 and give p = 0,
    alpha = 1 (never NaN)."""
    if MASK:
        s = gl.where(cols[None, :] < col_limit[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    # One FMA per score: s * qk_scale - m * qk_scale, then the hardware exp2.
    p = gl.exp2(s * qk_scale - (m_safe * qk_scale)[:, None])
    alpha = gl.exp2(gl.where(m_new == float("-inf"), 0.0, (m_i - m_new) * qk_scale))
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_new, alpha


@gluon.jit
def _consumer(q_desc, o_desc, LSE, q_smem, k_smem, v_smem,
              q_bars, k_ready, k_empty, v_ready, v_empty, sched,
              pid_bh, start_m, seqlen_q, seqlen_k, n_blocks, sm_scale, qk_scale,
              off_b, off_h,
              WG: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
              OVERLAP: gl.constexpr, PINGPONG: gl.constexpr):
    """One consumer partition: ROWS query rows (from start_m + WG * ROWS) against key blocks
    [0, n_blocks); writes O and the LSE of its rows."""
    dtype: gl.constexpr = q_desc.dtype
    SYNC: gl.constexpr = WARPS > 4
    # wgmma accumulator layouts: S [ROWS, BN] and O [ROWS, D]; warps stacked along the rows, so every
    # row lives in one warp (a quad of threads): row reductions need no shared memory.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    row0 = start_m + WG * ROWS
    rows = row0 + gl.arange(0, ROWS, layout=row_layout)                 # [ROWS] query positions
    cols0 = gl.arange(0, BLOCK_N, layout=col_layout)                    # [BN]
    causal_offset = seqlen_k - seqlen_q
    # Key blocks [0, n_full) are seen in full by every row of this warpgroup: no mask.
    # col_limit: row i sees keys < col_limit[i] (the end of the keys, or its causal diagonal + 1).
    if IS_CAUSAL:
        n_full = gl.minimum(gl.maximum(row0 + causal_offset + 1, 0) // BLOCK_N, seqlen_k // BLOCK_N)
        col_limit = gl.minimum(rows + causal_offset + 1, seqlen_k)
    else:
        n_full = seqlen_k // BLOCK_N
        col_limit = gl.full([ROWS], 0, gl.int32, row_layout) + seqlen_k

    q_tile = q_smem.index(WG)
    q_bar = q_bars.index(WG)
    mbarrier.wait(q_bar, 0)          # always: the query's TMA must land before this CTA may exit

    if n_blocks > 0:
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([ROWS], gl.float32, row_layout)
        if OVERLAP:
            # -- step 0: S_0 only --
            mbarrier.wait(k_ready.index(0), 0)
            _turn_begin(sched, 0, WG, PINGPONG)
            s_tok = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            _turn_end(sched, WG, PINGPONG)
            s = warpgroup_mma_wait(0, deps=(s_tok,))
            _release(k_empty.index(0), SYNC)
            if n_full > 0:
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, col_limit, cols0, qk_scale, False)
            else:
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, col_limit, cols0, qk_scale, True)
            p = gl.convert_layout(p.to(dtype), p_layout)
            # -- steps 1 .. n-1: issue S_j and P_{j-1} V_{j-1}; softmax S_j under the PV product --
            for j in range(1, n_blocks):
                st = j % STAGES
                ph = (j // STAGES) & 1
                pst = (j - 1) % STAGES
                pph = ((j - 1) // STAGES) & 1
                mbarrier.wait(k_ready.index(st), ph)
                mbarrier.wait(v_ready.index(pst), pph)
                _turn_begin(sched, j, WG, PINGPONG)
                s_tok = warpgroup_mma(q_tile, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                o_tok = warpgroup_mma(p, v_smem.index(pst), acc, is_async=True)
                _turn_end(sched, WG, PINGPONG)
                s = warpgroup_mma_wait(1, deps=(s_tok,))       # S_j done; PV may still run
                _release(k_empty.index(st), SYNC)
                cols = j * BLOCK_N + cols0
                if j < n_full:
                    p_new, m_i, l_i, alpha = _softmax(s, m_i, l_i, col_limit, cols, qk_scale, False)
                else:
                    p_new, m_i, l_i, alpha = _softmax(s, m_i, l_i, col_limit, cols, qk_scale, True)
                p_new = gl.convert_layout(p_new.to(dtype), p_layout)
                acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
                _release(v_empty.index(pst), SYNC)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                p = p_new
            # -- step n: the last P V --
            lst = (n_blocks - 1) % STAGES
            lph = ((n_blocks - 1) // STAGES) & 1
            mbarrier.wait(v_ready.index(lst), lph)
            _turn_begin(sched, n_blocks, WG, PINGPONG)
            o_tok = warpgroup_mma(p, v_smem.index(lst), acc, is_async=True)
            _turn_end(sched, WG, PINGPONG)
            acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
            _release(v_empty.index(lst), SYNC)
        else:
            # No intra-warpgroup overlap: S_j, softmax, P_j V_j, one after the other.
            for j in range(0, n_blocks):
                st = j % STAGES
                ph = (j // STAGES) & 1
                mbarrier.wait(k_ready.index(st), ph)
                _turn_begin(sched, 2 * j, WG, PINGPONG)
                s_tok = warpgroup_mma(q_tile, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                _turn_end(sched, WG, PINGPONG)
                s = warpgroup_mma_wait(0, deps=(s_tok,))
                _release(k_empty.index(st), SYNC)
                cols = j * BLOCK_N + cols0
                if j < n_full:
                    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, col_limit, cols, qk_scale, False)
                else:
                    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, col_limit, cols, qk_scale, True)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                p = gl.convert_layout(p.to(dtype), p_layout)
                mbarrier.wait(v_ready.index(st), ph)
                _turn_begin(sched, 2 * j + 1, WG, PINGPONG)
                o_tok = warpgroup_mma(p, v_smem.index(st), acc, is_async=True)
                _turn_end(sched, WG, PINGPONG)
                acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
                _release(v_empty.index(st), SYNC)
    else:
        # No visible key block at all: every row of this warpgroup is empty.
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([ROWS], gl.float32, row_layout)

    # -- epilogue: out = acc / l, lse = m * sm_scale + ln(l); empty rows (l = 0): 0 and -inf --
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), m_i * sm_scale + gl.log(l_safe))
    inv_l = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))
    out = (acc * inv_l[:, None]).to(dtype)
    gl.store(LSE + pid_bh.to(gl.int64) * seqlen_q + rows, lse, mask=rows < seqlen_q)
    # O goes out through the query's shared-memory tile (no wgmma reads it any more: every wgmma has
    # been waited for) and one TMA store, which drops the rows past seqlen_q. The first fence orders
    # the async proxy's earlier use of the tile (TMA write, wgmma reads) before these generic writes.
    fence_async_shared()
    q_tile.store(out)
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [off_b, row0, off_h, 0], q_tile)
    tma.store_wait(0)


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------

# Sequence lengths and head counts are not specialised on (divisibility by 16, value 1): the kernel
# does not use those facts, and each specialisation would be one more compile.
@gluon.jit(do_not_specialize=["num_heads_q", "kv_group_size", "seqlen_q", "seqlen_k", "num_m_blocks"])
def _attn_fwd_hopper_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE,
    num_heads_q, kv_group_size, seqlen_q, seqlen_k, num_m_blocks,
    sm_scale, qk_scale,
    HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
    PRODUCER_REGS_: gl.constexpr, CONSUMER_REGS_: gl.constexpr,
):
    """One program: BLOCK_M = ROWS * (2 if PINGPONG else 1) query rows of one (batch, query head)."""
    NUM_WG: gl.constexpr = 2 if PINGPONG else 1
    BLOCK_M: gl.constexpr = ROWS * NUM_WG
    WARPS: gl.constexpr = ROWS // 16
    dtype: gl.constexpr = q_desc.dtype

    # -- which (batch, head, query block); causal: heaviest (last) query block first --
    pid = gl.program_id(0)
    pid_m = pid % num_m_blocks
    if IS_CAUSAL:
        pid_m = num_m_blocks - 1 - pid_m
    pid_bh = pid // num_m_blocks
    off_b = pid_bh // num_heads_q
    off_h = pid_bh % num_heads_q
    off_hk = off_h // kv_group_size
    start_m = pid_m * BLOCK_M

    # -- key blocks this CTA visits: [0, n_blocks); none above the last row's causal diagonal --
    if IS_CAUSAL:
        hi = gl.minimum(gl.maximum(start_m + BLOCK_M + seqlen_k - seqlen_q, 0), seqlen_k)
    else:
        hi = seqlen_k
    n_blocks = gl.cdiv(hi, BLOCK_N)

    # -- shared memory: query tile(s) (reused for O), the K/V ring, barriers --
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, ROWS, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(NUM_WG):
        mbarrier.init(q_bars.index(w), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=NUM_WG)       # every consumer warpgroup releases
        mbarrier.init(v_empty.index(s), count=NUM_WG)
    for w in gl.static_range(2):
        mbarrier.init(sched.index(w), count=1)

    if PINGPONG:
        gl.warp_specialize([
            (_consumer, (q_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                         v_empty, sched, pid_bh, start_m, seqlen_q, seqlen_k, n_blocks, sm_scale, qk_scale,
                         off_b, off_h, 0, ROWS, WARPS, BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL, OVERLAP,
                         PINGPONG)),
            (_consumer, (q_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                         v_empty, sched, pid_bh, start_m, seqlen_q, seqlen_k, n_blocks, sm_scale, qk_scale,
                         off_b, off_h, 1, ROWS, WARPS, BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL, OVERLAP,
                         PINGPONG)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                         v_empty, off_b, off_h, off_hk, start_m, n_blocks, ROWS, NUM_WG, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])
    else:
        gl.warp_specialize([
            (_consumer, (q_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                         v_empty, sched, pid_bh, start_m, seqlen_q, seqlen_k, n_blocks, sm_scale, qk_scale,
                         off_b, off_h, 0, ROWS, WARPS, BLOCK_N, HEAD_DIM, STAGES, IS_CAUSAL, OVERLAP,
                         PINGPONG)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                         v_empty, off_b, off_h, off_hk, start_m, n_blocks, ROWS, NUM_WG, BLOCK_N, STAGES)),
        ], [1], [PRODUCER_REGS_])


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def _descriptor(t: torch.Tensor, rows: int, head_dim: int) -> GluonTensorDescriptor:
    """Host-built 4-D [B, S, H, D] descriptor moving [1, rows, 1, D] boxes (one (batch, head)'s block
    of rows), 128-byte swizzled like the kernel's shared-memory tiles. Built without the dataclass's
    re-validation (``supported`` already checked what TMA needs): host time per call matters at
    short sequences."""
    layout = gl.NVMMASharedLayout.get_default_for([1, rows, 1, head_dim], _GL_DTYPES[t.dtype])
    desc = object.__new__(GluonTensorDescriptor)
    desc.base, desc.shape, desc.strides = t, list(t.shape), list(t.stride())
    desc.block_shape, desc.layout, desc.padding = [1, rows, 1, head_dim], layout, "zero"
    return desc


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """True when this Hopper path handles the inputs: CUDA fp16/bf16 [B, S, H, D] views, head_dim 64
    or 128, same dtype everywhere, Hq a multiple of Hkv, TMA-compatible strides (``tma_compatible``)."""
    tensors = (q, k, v) if out is None else (q, k, v, out)
    if any(t.dim() != 4 or not t.is_cuda or t.dtype != q.dtype for t in tensors):
        return False
    if q.dtype not in _GL_DTYPES:
        return False
    b, sq, hq, d = q.shape
    if d not in (64, 128) or k.shape[-1] != d or v.shape != k.shape or k.shape[0] != b:
        return False
    if k.shape[2] == 0 or hq % k.shape[2]:
        return False
    if out is not None and tuple(out.shape) != tuple(q.shape):
        return False
    return tma_compatible(*tensors)


@on_input_device
def forward_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool,
                   out: torch.Tensor | None = None, variant: str | None = None):
    """``forward()``'s contract on the Hopper kernel: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D];
    returns (out [B, Sq, Hq, D] in q's dtype, lse [B, Hq, Sq] float32, natural log). ``out`` may be a
    preallocated strided view. ``variant``: a key of VARIANTS (None: DEFAULT_VARIANT)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_k, _ = k.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if seqlen_k == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    cfg = variant_config(variant, head_dim)
    q_desc = _descriptor(q, cfg["rows"], head_dim)
    o_desc = _descriptor(out, cfg["rows"], head_dim)
    k_desc = _descriptor(k, cfg["block_n"], head_dim)
    v_desc = _descriptor(v, cfg["block_n"], head_dim)
    num_m_blocks = triton.cdiv(seqlen_q, cfg["block_m"])
    grid = (num_m_blocks * batch * heads_q,)
    _attn_fwd_hopper_kernel[grid](
        q_desc, k_desc, v_desc, o_desc, lse,
        heads_q, heads_q // heads_k, seqlen_q, seqlen_k, num_m_blocks,
        sm_scale, sm_scale * LOG2E,
        HEAD_DIM=head_dim, ROWS=cfg["rows"], BLOCK_N=cfg["block_n"], STAGES=cfg["stages"],
        IS_CAUSAL=causal, OVERLAP=cfg["overlap"], PINGPONG=cfg["pingpong"],
        PRODUCER_REGS_=PRODUCER_REGS, CONSUMER_REGS_=CONSUMER_REGS,
        num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"],
    )
    return out, lse
