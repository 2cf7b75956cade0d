"""FlashAttention forward for Hopper (sm_90) in Gluon: warp-specialized, TMA-fed, async wgmma.

Where the portable kernel (forward.py) leaves scheduling to the compiler, this one schedules by hand,
as FlashAttention-3 does (the design, with the measurements behind each choice: docs/hopper.md):

* a **producer** warp (``_producer``) only issues TMA copies: the query tiles, then K and V tiles
  into a ring of ``STAGES`` shared-memory slots, connected to the consumers by mbarriers
  (docs/hopper.md#rings-and-barriers); it gives its registers to the consumers (setmaxnreg);
* one to three **consumer** warpgroups (``_consumer``, 64 query rows each) compute S = Q K^T and
  O += P V with wgmma and the online softmax in registers, overlapping one step's softmax with the
  previous step's P V (OVERLAP; docs/hopper.md#forward-step-schedule) and taking turns at the tensor
  cores (PINGPONG; docs/hopper.md#ping-pong);
* persistent launches (one CTA per SM) walk the tiles in a cost-balancing order (ORDER, ``tile_order``,
  ``snake_section``; docs/hopper.md#persistent-scheduling-and-tile-orders);
* optional: row sums on the tensor cores (LTC, fp16 only; docs/hopper.md#row-sums-on-the-tensor-cores)
  and skipping the key blocks a warpgroup's rows do not see (SKIP;
  docs/hopper.md#skipping-blocks-a-warpgroup-does-not-see).

``VARIANTS`` names the combinations; ``dispatch.forward_variant`` picks one per shape.

Numerics are forward.py's: fp32 online-softmax state, base-2 exponentials with the scale folded into
one FMA, masked scores -inf, rows that see no key give out = 0 and lse = -inf (with a sink: the
sink), LSE in natural log. Score variants: ``sm90_common.Scores`` (softcap: the running max in natural
units then) and ``fold_sink``.
Key blocks above the causal diagonal are never loaded. Shapes: q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D]
with strides TMA accepts (``sm90_common.tma_supported``), read through host-built 4-D descriptors of
[1, rows, 1, D] boxes into 128-byte-swizzled [rows, D] tiles, the operand layout wgmma reads. Packed
sequences (``varlen``, PACKED: docs/hopper.md#packed-sequences): q / out [total_q, Hq, D], k / v
[total_k, Hkv, D] through [1, total, H, D] views, lse [Hq, total_q]; O written by masked stores.
"""

import functools

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
from .block_ranges import causal_key_range, window_kernel_args
from .common import PLAIN as NO_SCORES
from .common import ScoreVariant, Varlen, on_input_device
from .configs import cdiv, sm_count
from .sm90_common import (
    PAIRED,
    PLAIN,
    PRODUCER_REGS,
    REGISTER_FILE,
    SCALAR,
    SMEM,
    SNAKE,
    Packed,
    Ring,
    ScoreArgs,
    Tiles,
    Window,
    aggregate,
    constexprs,
    descriptor,
    finish_rows,
    fold_sink,
    natural_units,
    release,
    row_limits,
    score_launch_args,
    sequences,
    softmax,
    to_operand,
    zero_rows_past,
)

# --------------------------------------------------------------------------------------------------
# Variants: the ones dispatch.forward_variant picks. name -> (head_dim -> config dict)
# --------------------------------------------------------------------------------------------------
#   block_n: keys per tile; stages: K/V ring depth; overlap: intra-warpgroup S/PV overlap (True: one
#   loop; 2: unmasked and masked steps in two loops, docs/hopper.md#forward-step-schedule);
#   num_wg: consumer warpgroups, 64 query rows each, each its own partition (2 or 3);
#   pingpong: the num_wg warpgroups take turns issuing their wgmmas (round robin);
#   persistent: one CTA per SM, looping over the (query block, batch, head) tiles;
#   ltc: row sums on the tensor cores (fp16 only);
#   skip: causal launches skip, per warpgroup, the tile's key blocks its rows do not see (default: on
#   for three warpgroups in the split-loop schedule).
# Variants tried and dropped (one-partition warpgroups, 64-key tiles, no overlap) are described in
# docs/performance-notes.md#forward-on-hopper.

# Shared memory per CTA (fp16/bf16): Q and O tiles num_wg * 64*D*2 each, plus stages * 2 * BN*D*2.
#   D=128, BN=128, 2 warpgroups: 32 + 32 KiB + stages * 64 KiB -> 2 stages = 192 KiB;
#   D=64, BN=128, 3 warpgroups: 24 + 24 KiB + stages * 32 KiB -> 3 stages = 144 KiB.
_PP = dict(block_n=128, overlap=True, pingpong=True)
VARIANTS = {
    # FA3's schedule: producer warp + two consumer warpgroups in ping-pong, intra-warpgroup overlap.
    "pp": {64: dict(_PP, stages=3, num_wg=2), 128: dict(_PP, stages=2, num_wg=2)},
    # The same, persistent: the next tile's Q and first K/V tiles load during this tile's last steps.
    "pp_persist": {64: dict(_PP, stages=3, num_wg=2, persistent=True),
                   128: dict(_PP, stages=2, num_wg=2, persistent=True)},
    # Three consumer warpgroups (192 query rows per CTA; FA3's D=64 schedule): the K/V tile in shared
    # memory is read by three warpgroups, so a CTA needs 2/3 of the shared-memory bandwidth per FLOP
    # that two need; in the split-loop schedule (overlap=2).
    "pp3_persist": {64: dict(_PP, stages=2, num_wg=3, persistent=True, overlap=2)},
    # The same with the row sums on the tensor cores: fp16 only.
    "pp3_persist_ltc": {64: dict(_PP, stages=2, num_wg=3, persistent=True, ltc=True, overlap=2)},
}



def variant_config(variant: str, head_dim: int) -> dict:
    cfg = dict(VARIANTS[variant][head_dim])
    cfg.setdefault("persistent", False)
    cfg.setdefault("ltc", False)
    num_wg = cfg["num_wg"]
    warps = 4                                             # one warpgroup per consumer partition
    cfg["rows"] = 16 * warps                              # query rows of one consumer partition
    cfg["block_m"] = cfg["rows"] * num_wg
    # Causal launches: a consumer warpgroup skips the tile's key blocks its rows do not see. On for
    # the three-warpgroup split-loop variants (192 rows of 128-key blocks), where it pays; at 128 rows
    # of 128 keys the check alone costs more than it saves (docs/hopper.md#skipping-blocks-a-warpgroup-does-not-see).
    cfg.setdefault("skip", num_wg == 3 and cfg["overlap"] == 2)
    cfg["num_warps"] = warps                              # the default partition's warps
    # Warps of the launch, counted in whole warpgroups (registers are reallocated per warpgroup):
    # consumers + the producer's warpgroup. maxnreg * threads must fit the register file.
    consumer_threads = 32 * warps * num_wg
    cfg.setdefault("maxnreg", min(256, (REGISTER_FILE // (consumer_threads + 128)) // 8 * 8))
    # A worker consumer's setmaxnreg: what is left once the producer's warpgroup has PRODUCER_REGS.
    cfg["consumer_regs"] = min(240, ((REGISTER_FILE - 128 * PRODUCER_REGS) // consumer_threads) // 8 * 8)
    return cfg


# --------------------------------------------------------------------------------------------------
# Kernel state: the tile config, the kernel's inputs and outputs, its shared memory
# --------------------------------------------------------------------------------------------------

@aggregate
class FwdConfig:
    """The compile-time configuration of a launch (the kernel's constexpr arguments) and the register
    layouts of a consumer warpgroup: wgmma accumulators S [ROWS, BLOCK_N] and O [ROWS, HEAD_DIM] with
    the warps stacked along the rows (every row lives in one warp: row reductions need no shared
    memory); P as the A operand of P V; LTC's row-sum accumulator [ROWS, 8] and its A operand;
    ``ld_layout``, 16-byte vectors along a row, for packed sequences' reads and writes of shared tiles."""
    HEAD_DIM: gl.constexpr
    ROWS: gl.constexpr
    NUM_WG: gl.constexpr
    BLOCK_N: gl.constexpr
    STAGES: gl.constexpr
    IS_CAUSAL: gl.constexpr
    OVERLAP: gl.constexpr
    PINGPONG: gl.constexpr
    ORDER: gl.constexpr
    LTC: gl.constexpr
    SKIP: gl.constexpr
    WARPS: gl.constexpr
    SYNC: gl.constexpr
    dtype: gl.constexpr
    s_layout: gl.constexpr
    o_layout: gl.constexpr
    p_layout: gl.constexpr
    l_layout: gl.constexpr
    pl_layout: gl.constexpr
    row_layout: gl.constexpr
    col_layout: gl.constexpr
    ld_layout: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, HEAD_DIM, ROWS, NUM_WG, BLOCK_N, STAGES, IS_CAUSAL, OVERLAP, PINGPONG, ORDER, LTC, SKIP,
                 dtype):
        constexprs(self, HEAD_DIM=HEAD_DIM, ROWS=ROWS, NUM_WG=NUM_WG, BLOCK_N=BLOCK_N, STAGES=STAGES,
                   IS_CAUSAL=IS_CAUSAL, OVERLAP=OVERLAP, PINGPONG=PINGPONG, ORDER=ORDER, LTC=LTC, SKIP=SKIP,
                   dtype=dtype)
        warps = self.ROWS.value // 16
        s = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                      instr_shape=[16, self.BLOCK_N.value, 16])
        o = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                      instr_shape=[16, self.HEAD_DIM.value, 16])
        l = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8, 16])
        constexprs(self, WARPS=warps, SYNC=warps > 4, s_layout=s, o_layout=o,
                   p_layout=gl.DotOperandLayout(operand_index=0, parent=o, k_width=2), l_layout=l,
                   pl_layout=gl.DotOperandLayout(operand_index=0, parent=l, k_width=2),
                   row_layout=gl.SliceLayout(1, s), col_layout=gl.SliceLayout(0, s),
                   ld_layout=gl.BlockedLayout([1, 8], [256 // self.HEAD_DIM.value, self.HEAD_DIM.value // 8],
                                              [warps, 1], [1, 0]))


@aggregate
class FwdIO:
    """The tensors a launch reads and writes (Q, K, V, O through TMA descriptors, the LSE by pointer),
    the softmax scales (the online softmax's qk_scale and the epilogue's sm_scale: the units of the
    running max) and the score variants (``scores``). Packed sequences write O by pointer (``O``, its
    token and head strides; a TMA store would overwrite the next sequence's rows) and the LSE
    [Hq, total_q] with head stride ``stride_lh``; dense launches pass None for the four."""
    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    o_desc: tma.tensor_descriptor
    LSE: gl.tensor
    sm_scale: gl.tensor
    qk_scale: gl.tensor
    scores: ScoreArgs
    O: SCALAR
    stride_ot: SCALAR
    stride_oh: SCALAR
    stride_lh: SCALAR

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, v_desc, o_desc, LSE, sm_scale, qk_scale, scores, O, stride_ot, stride_oh,
                 stride_lh):
        self.q_desc, self.k_desc, self.v_desc, self.o_desc = q_desc, k_desc, v_desc, o_desc
        self.LSE, self.sm_scale, self.qk_scale, self.scores = LSE, sm_scale, qk_scale, scores
        constexprs(self, O=O, stride_ot=stride_ot, stride_oh=stride_oh, stride_lh=stride_lh)


@aggregate
class Turns:
    """Ping-pong (PINGPONG): the consumer warpgroups take turns issuing their wgmmas, round robin,
    warpgroup 0 first, through one mbarrier per warpgroup (``bars``, [NUM_WG, 1]). Turns are counted
    over all of the CTA's tiles. Each hand-over completes one phase of the receiver's barrier, so the
    (t+1)-th phase of bars[w] marks turn t (parity t & 1), and bars[0]'s t-th phase marks warpgroup
    0's turn t (parity (t - 1) & 1; turn 0 needs no token)."""
    bars: SMEM
    NUM_WG: gl.constexpr
    PINGPONG: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, bars, NUM_WG, PINGPONG):
        self.bars = bars
        constexprs(self, NUM_WG=NUM_WG, PINGPONG=PINGPONG)

    @gluon.jit
    def begin(self, t, WG: gl.constexpr):
        """Wait until warpgroup WG may issue the wgmmas of its turn t."""
        if self.PINGPONG:
            if WG == 0:
                mbarrier.wait(self.bars.index(0), (t + 1) & 1, pred=t > 0)
            else:
                mbarrier.wait(self.bars.index(WG), t & 1)

    @gluon.jit
    def end(self, WG: gl.constexpr):
        """Warpgroup WG's wgmmas of the turn are issued: hand the turn to the next one."""
        if self.PINGPONG:
            mbarrier.arrive(self.bars.index((WG + 1) % self.NUM_WG), count=1)


@aggregate
class FwdShared:
    """A CTA's shared memory: the query tiles (one slot per consumer warpgroup, ``q``), the output
    tiles (``o``), the K and V rings (one slot number and counter for both, separate barriers so S can
    start before V lands), the ping-pong barriers and (LTC) the [BLOCK_N, 8] tile of ones."""
    q: Ring
    o: SMEM
    k: Ring
    v: Ring
    turns: Turns
    ones: SMEM

    @gluon.constexpr_function
    def __init__(self, q, o, k, v, turns, ones):
        self.q, self.o, self.k, self.v, self.turns, self.ones = q, o, k, v, turns, ones


# --------------------------------------------------------------------------------------------------
# Partitions
# --------------------------------------------------------------------------------------------------

@gluon.jit
def _load_q(cfg, io, sh, off_b, off_h, start_m, phase):
    """The query tiles of one tile, one per consumer warpgroup, each once its previous one is free
    (``off_b``: the descriptor's batch index; ``start_m``: the tile's first row in the descriptor)."""
    for w in gl.static_range(cfg.NUM_WG):
        sh.q.acquire_at(w, phase ^ 1)                      # a fresh barrier passes parity 1 at once
        sh.q.expect(w, io.q_desc.block_type.nbytes)
        sh.q.load(io.q_desc, [off_b, start_m + w * cfg.ROWS, off_h, 0], w)


@gluon.jit
def _producer(cfg, tiles, io, sh):
    """One warp: for each tile, TMA loads of the query tiles and of K_j, V_j for j in [first, n_blocks).
    ``kv`` counts K/V tiles over all of this CTA's tiles: it picks the ring slot and its phase."""
    kv = 0
    n_done = 0
    for item in range(gl.program_id(0), tiles.bound(), gl.num_programs(0)):
        for half in range(2 if cfg.ORDER == PAIRED else 1):
            pid_bh, off_b, off_h, off_hk, start_m, first, n_blocks, valid, q0, k0, _, _ = tiles.walk(item, half)
            desc_b = tiles.packed.batch_index(off_b)
            if valid:
                if tiles.window.ON:                # (a compile-time choice: see _consumer's WINDOW)
                    no_blocks = n_blocks <= first
                else:
                    no_blocks = n_blocks == 0
                if no_blocks:
                    _load_q(cfg, io, sh, desc_b, off_h, q0 + start_m, n_done & 1)
                for j in range(first, n_blocks):
                    s = sh.k.index(kv)
                    empty_phase = sh.k.phase(kv) ^ 1
                    start_n = k0 + j * cfg.BLOCK_N
                    # K first: the consumers need K_j (for S_j) before V_j (for the PV product one
                    # step later). A tile's K_0 goes before its query tiles: its ring slot is free
                    # earlier than they are (released after the previous tile's last S product).
                    sh.k.acquire_at(s, empty_phase)
                    sh.k.fill(io.k_desc, [desc_b, start_n, off_hk, 0], s)
                    if j == first:
                        _load_q(cfg, io, sh, desc_b, off_h, q0 + start_m, n_done & 1)
                    sh.v.acquire_at(s, empty_phase)
                    sh.v.fill(io.v_desc, [desc_b, start_n, off_hk, 0], s)
                    kv += 1
                n_done += 1


@gluon.jit
def _pv_issue(cfg, sh, p, v_tile, acc, l_acc):
    """Issue O += P V (async) and, LTC, l += P @ ones beside it. Returns the tokens and the operands
    the wait must keep live: (o_tok, l_tok, p_l); without LTC, l_tok and p_l are placeholders."""
    o_tok = warpgroup_mma(p, v_tile, acc, is_async=True)
    if cfg.LTC:
        p_l = gl.convert_layout(p, cfg.pl_layout)
        l_tok = warpgroup_mma(p_l, sh.ones, l_acc, is_async=True)
    else:
        p_l = p
        l_tok = l_acc
    return o_tok, l_tok, p_l


@gluon.jit
def _pv_wait(o_tok, l_tok, p, p_l, LTC: gl.constexpr):
    """Wait for everything ``_pv_issue`` started (its register operands stay live until then).
    Returns (acc, l_acc)."""
    if LTC:
        acc, l_acc, p, p_l = warpgroup_mma_wait(0, deps=(o_tok, l_tok, p, p_l))
    else:
        acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
        l_acc = l_tok
    return acc, l_acc


@gluon.jit
def _s_wait(cfg, s_tok, k_slot_empty):
    """Wait for this step's S product only (P V, and LTC's row-sum product, may still run), then
    release its K slot. Returns S."""
    if cfg.LTC:
        s = warpgroup_mma_wait(2, deps=(s_tok,))
    else:
        s = warpgroup_mma_wait(1, deps=(s_tok,))
    release(k_slot_empty, cfg.SYNC)
    return s


@gluon.jit
def _pv_finish(cfg, o_tok, l_tok, p, p_l, alpha, v_slot_empty):
    """Wait for the previous step's P V (and l), release its V slot, and rescale O (and LTC's l) by
    this step's alpha. Returns (acc, l_acc)."""
    acc, l_acc = _pv_wait(o_tok, l_tok, p, p_l, cfg.LTC)
    if cfg.LTC:
        l_acc = l_acc * gl.convert_layout(alpha, gl.SliceLayout(1, cfg.l_layout))[:, None]
    release(v_slot_empty, cfg.SYNC)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, cfg.o_layout))[:, None]
    return acc, l_acc


@gluon.jit
def _overlap_step(cfg, sh, WG: gl.constexpr, j, c, t, p, acc, l_acc, m_i, l_i, q_tile, s_zero, col_limit,
                  cols0, qk_scale, mod, MASK: gl.constexpr, col_start=None):
    """One step j > 0 of the split-loop schedule (OVERLAP = 2; K/V tile number c, ping-pong turn t):
    issue S_j = Q K_j^T, then (once V_{j-1} has landed) O += P_{j-1} V_{j-1}; softmax S_j while P V
    runs; wait for it and rescale. Returns (P_j as the wgmma A operand, acc, l_acc, m, l). MASK: S_j
    needs the per-row column limit (a compile-time choice: the caller runs the unmasked steps and the
    masked ones in two loops, so a step has no branch and ptxas schedules the softmax, the P V wait and
    the O rescale as one block)."""
    st = sh.k.index(c)
    pst = sh.v.index(c - 1)
    sh.k.wait(c)
    sh.turns.begin(t, WG)
    s_tok = warpgroup_mma(q_tile, sh.k.tile(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    sh.v.wait(c - 1)
    o_tok, l_tok, p_l = _pv_issue(cfg, sh, p, sh.v.tile(pst), acc, l_acc)
    sh.turns.end(WG)
    s = _s_wait(cfg, s_tok, sh.k.empty_bar(st))
    cols = j * cfg.BLOCK_N + cols0
    s = mod.apply(s, cols)
    p_new, m_i, l_i, alpha = softmax(s, m_i, l_i, col_limit, cols, qk_scale, MASK, not cfg.LTC, col_start)
    p_new = to_operand(p_new, cfg.dtype, cfg.p_layout)
    acc, l_acc = _pv_finish(cfg, o_tok, l_tok, p, p_l, alpha, sh.v.empty_bar(pst))
    return p_new, acc, l_acc, m_i, l_i


@gluon.jit
def _blocks_seen(row0, ROWS: gl.constexpr, seqlen_q, seqlen_k, n_blocks, BLOCK_N: gl.constexpr,
                 IS_CAUSAL: gl.constexpr):
    """How many of the tile's key blocks [0, n_blocks) a warpgroup's query rows [row0, row0 + ROWS)
    see: up to its last row's causal diagonal (bottom-right aligned), and none when all of its rows
    are past the end of the queries (the last tile's lower warpgroups). The tile's n_blocks reach
    the diagonal of the tile's last row, so with 192-row tiles of 128-key blocks the upper
    warpgroups of a causal tile see one block fewer, half the time two of them."""
    n = n_blocks
    if IS_CAUSAL:
        # The rows' key range (rows past the queries see no more keys than the last query row does).
        _, hi = causal_key_range(row0, seqlen_q, seqlen_k, ROWS, BLOCK_N, IS_CAUSAL)
        n = gl.minimum(gl.cdiv(hi, BLOCK_N), n_blocks)
    if seqlen_q <= row0:
        n = 0
    return n


@gluon.jit
def _pass_blocks(cfg, sh, WG: gl.constexpr, kv, turn, n_mine, n_blocks):
    """A warpgroup's part in its tile's key blocks [n_mine, n_blocks), which none of its rows see
    (``_blocks_seen``); ``kv`` and ``turn`` are the K/V tile count and the ping-pong turn at the
    start of the tile. Every ring slot still needs this warpgroup's release, and the ping-pong token
    still goes round every warpgroup, so it releases each block once it has landed (never before:
    an early arrive could count towards the slot's previous use) and hands on the turns its steps
    would have taken in the OVERLAP schedule: the tile's step 0 at ``turn`` (when it had no step of
    its own) and block b's P V at ``turn + b + 1``. It waits for nothing a computing warpgroup would
    not wait for by the same turn, so no wait can close a cycle."""
    if n_blocks > 0:
        if n_mine == 0:
            sh.turns.begin(turn, WG)
            sh.turns.end(WG)
    for b in range(n_mine, n_blocks):
        c = kv + b
        st = sh.k.index(c)
        ph = sh.k.phase(c)
        sh.k.wait_at(st, ph)
        sh.k.release(st, cfg.SYNC)
        sh.v.wait_at(st, ph)
        sh.v.release(st, cfg.SYNC)
        sh.turns.begin(turn + b + 1, WG)
        sh.turns.end(WG)


@gluon.jit
def _store_packed(cfg, io, o_tile, out, row, off_h, n_rows):
    """Packed sequences: write a warpgroup's output rows, the first at ``row`` of the packed out, the
    ones from ``n_rows`` on (past the sequence's end: the next sequence's rows) not at all. Through
    the warpgroup's shared-memory tile, to store whole 16-byte vectors along each row."""
    gl.thread_barrier()                   # every warp has read the tile's previous rows
    o_tile.store(out)
    gl.thread_barrier()
    vals = o_tile.load(cfg.ld_layout)
    r = gl.arange(0, cfg.ROWS, layout=gl.SliceLayout(1, cfg.ld_layout))
    c = gl.arange(0, cfg.HEAD_DIM, layout=gl.SliceLayout(0, cfg.ld_layout))
    ptrs = io.O + (row + r).to(gl.int64)[:, None] * io.stride_ot + off_h * io.stride_oh + c[None, :]
    gl.store(ptrs, vals, mask=(r < n_rows)[:, None])


@gluon.jit
def _consumer(cfg, WG: gl.constexpr, tiles, io, sh):
    """Consumer warpgroup WG: for each of the CTA's tiles, ROWS query rows (from start_m + WG * ROWS)
    against key blocks [first, n_blocks) (first = 0 without a window; SKIP: computes on the first
    n_mine of them, the ones its rows see, and only passes the rest on); writes O and the LSE of its
    rows. ``kv`` (the K/V tile count,
    as in the producer) gives ring slots and phases; ``turn`` counts ping-pong turns; ``n_done``
    counts tiles (the query slot's phase). LTC: the row sums come from P @ ones (``sh.ones``)."""
    dtype: gl.constexpr = cfg.dtype
    SYNC: gl.constexpr = cfg.SYNC
    ROWS: gl.constexpr = cfg.ROWS
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    LTC: gl.constexpr = cfg.LTC
    SKIP: gl.constexpr = cfg.SKIP
    o_layout: gl.constexpr = cfg.o_layout
    row_layout: gl.constexpr = cfg.row_layout
    gl.static_assert(cfg.OVERLAP > 0 or not LTC, "LTC (row sums on the tensor cores) needs the OVERLAP schedule")
    gl.static_assert(cfg.OVERLAP > 0 or not SKIP, "SKIP passes turns in the OVERLAP schedule's order")
    # WINDOW picks the windowed form of each bound below at compile time: written with first = 0 and
    # full_lo = 0 the plain kernels' code changes (ptxas does not fold them away).
    WINDOW: gl.constexpr = tiles.window.ON
    gl.static_assert(not (SKIP and WINDOW), "SKIP walks key blocks from 0: no window")
    cols0 = gl.arange(0, BLOCK_N, layout=cfg.col_layout)                # [BN]
    q_tile = sh.q.tile(WG)
    o_tile = sh.o.index(WG)
    q_bar = sh.q.ready.index(WG)          # (hoisted by hand: the same SASS as before the aggregates)
    seqlen_q = tiles.seqlen_q
    seqlen_k = tiles.seqlen_k
    qk_scale = io.qk_scale
    causal_offset = seqlen_k - seqlen_q

    kv = 0
    turn = 0
    n_done = 0
    for item in range(gl.program_id(0), tiles.bound(), gl.num_programs(0)):
        for half in range(2 if cfg.ORDER == PAIRED else 1):
            pid_bh, off_b, off_h, off_hk, start_m, first, n_blocks, valid, q0, _, seq_q, seq_k = tiles.walk(item, half)
            if tiles.packed.ON:
                # The tile's sequence's own lengths (dense: the launch's, set once above).
                seqlen_q = seq_q
                seqlen_k = seq_k
                causal_offset = seqlen_k - seqlen_q
            if valid:
                row0 = start_m + WG * ROWS
                rows = row0 + gl.arange(0, ROWS, layout=row_layout)             # [ROWS] query positions
                mod = io.scores.tile(off_b, off_h, rows, causal_offset)         # score variants (else a no-op)
                # Key blocks [full_lo, n_full) are seen in full by every row of this warpgroup: no
                # mask (full_lo = 0 without a window); row i sees keys [col_start[i], col_limit[i]).
                col_start = None
                if WINDOW:
                    full_lo, n_full, col_limit = tiles.window.row_limits(row0, rows, causal_offset, seqlen_k,
                                                                         ROWS, BLOCK_N)
                    if tiles.window.HAS_LEFT:
                        col_start = tiles.window.col_start(rows, causal_offset)
                else:
                    n_full, col_limit = row_limits(row0, rows, causal_offset, seqlen_k, ROWS, BLOCK_N,
                                                    cfg.IS_CAUSAL, row_layout)
                # Key blocks [0, n_mine) hold every key this warpgroup's rows see (SKIP; else all of
                # the tile's n_blocks, which reach the causal diagonal of the tile's last row).
                n_mine = n_blocks
                if SKIP:
                    n_mine = _blocks_seen(row0, ROWS, seqlen_q, seqlen_k, n_blocks, BLOCK_N, cfg.IS_CAUSAL)

                mbarrier.wait(q_bar, n_done & 1)   # always: the query's TMA must land before the tile is done

                if n_mine > first:
                    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, cfg.s_layout)
                    acc = gl.zeros([ROWS, cfg.HEAD_DIM], gl.float32, o_layout)
                    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
                    l_i = gl.zeros([ROWS], gl.float32, row_layout)
                    l_acc = gl.zeros([ROWS, 8], gl.float32, cfg.l_layout)
                    if cfg.OVERLAP:
                        # -- step 0: S_0 only --
                        st = sh.k.index(kv)
                        sh.k.wait(kv)
                        sh.turns.begin(turn, WG)
                        s_tok = warpgroup_mma(q_tile, sh.k.tile(st).permute((1, 0)), s_zero, use_acc=False,
                                              is_async=True)
                        sh.turns.end(WG)
                        s = warpgroup_mma_wait(0, deps=(s_tok,))
                        sh.k.release(st, SYNC)
                        if WINDOW:
                            cols_first = first * BLOCK_N + cols0
                        else:
                            cols_first = cols0
                        s = mod.apply(s, cols_first)
                        if WINDOW:
                            first_full = (full_lo <= first) & (first < n_full)     # step 0 needs no mask
                        else:
                            first_full = n_full > 0
                        if first_full:
                            p, m_i, l_i, alpha = softmax(s, m_i, l_i, col_limit, cols_first, qk_scale, False,
                                                          not LTC)
                        else:
                            p, m_i, l_i, alpha = softmax(s, m_i, l_i, col_limit, cols_first, qk_scale, True,
                                                          not LTC, col_start)
                        p = gl.convert_layout(p.to(dtype), cfg.p_layout)
                        # -- steps first+1 .. n-1: issue S_j and P_{j-1} V_{j-1}; softmax S_j under PV --
                        if cfg.OVERLAP >= 2:
                            # Unmasked steps [lo, n_lo) then masked ones [n_lo, n_mine) in two loops
                            # (with a window, masked ones [first + 1, lo) before them): no branch
                            # inside a step (static_range unrolls the pair).
                            n_lo = gl.maximum(gl.minimum(n_full, n_mine), first + 1)
                            lo = first + 1
                            if WINDOW:
                                lo = gl.minimum(gl.maximum(full_lo, first + 1), n_lo)
                                for j in range(first + 1, lo):
                                    p, acc, l_acc, m_i, l_i = _overlap_step(
                                        cfg, sh, WG, j, kv + j - first, turn + j - first, p, acc, l_acc, m_i, l_i,
                                        q_tile, s_zero, col_limit, cols0, qk_scale, mod, True, col_start)
                            for masked in gl.static_range(2):
                                for j in range(lo + (n_lo - lo) * masked, n_lo + (n_mine - n_lo) * masked):
                                    p, acc, l_acc, m_i, l_i = _overlap_step(
                                        cfg, sh, WG, j, kv + j - first, turn + j - first, p, acc, l_acc, m_i, l_i,
                                        q_tile, s_zero, col_limit, cols0, qk_scale, mod, masked == 1, col_start)
                        else:
                            for j in range(first + 1, n_mine):
                                c = kv + j - first
                                st = sh.k.index(c)
                                pst = sh.v.index(c - 1)
                                sh.k.wait(c)
                                sh.v.wait(c - 1)
                                sh.turns.begin(turn + j - first, WG)
                                s_tok = warpgroup_mma(q_tile, sh.k.tile(st).permute((1, 0)), s_zero,
                                                      use_acc=False, is_async=True)
                                o_tok, l_tok, p_l = _pv_issue(cfg, sh, p, sh.v.tile(pst), acc, l_acc)
                                sh.turns.end(WG)
                                s = _s_wait(cfg, s_tok, sh.k.empty_bar(st))
                                cols = j * BLOCK_N + cols0
                                s = mod.apply(s, cols)
                                if WINDOW:
                                    unmasked = (j < n_full) & (j >= full_lo)
                                else:
                                    unmasked = j < n_full
                                if unmasked:
                                    p_new, m_i, l_i, alpha = softmax(s, m_i, l_i, col_limit, cols, qk_scale,
                                                                      False, not LTC)
                                else:
                                    p_new, m_i, l_i, alpha = softmax(s, m_i, l_i, col_limit, cols, qk_scale,
                                                                      True, not LTC, col_start)
                                p_new = gl.convert_layout(p_new.to(dtype), cfg.p_layout)
                                acc, l_acc = _pv_finish(cfg, o_tok, l_tok, p, p_l, alpha, sh.v.empty_bar(pst))
                                p = p_new
                        # Every S product of the tile is done: the query tile may be refilled.
                        sh.q.release(WG, SYNC)
                        # -- step n: the last P V --
                        lc = kv + n_mine - 1 - first
                        lst = sh.v.index(lc)
                        sh.v.wait(lc)
                        if tiles.packed.ON:   # (only the last block can reach past the sequence's keys)
                            zero_rows_past(sh.v.tile(lst), n_mine - 1, seqlen_k, BLOCK_N, cfg.ld_layout)
                        sh.turns.begin(turn + n_mine - first, WG)
                        o_tok, l_tok, p_l = _pv_issue(cfg, sh, p, sh.v.tile(lst), acc, l_acc)
                        sh.turns.end(WG)
                        acc, l_acc = _pv_wait(o_tok, l_tok, p, p_l, LTC)
                        if LTC:
                            l_i = gl.convert_layout(gl.max(l_acc, 1), row_layout)
                        sh.v.release(lst, SYNC)
                        if not SKIP:             # (SKIP: the counters advance below, by the whole tile)
                            turn += n_blocks - first + 1
                    else:
                        # No intra-warpgroup overlap: S_j, softmax, P_j V_j, one after the other.
                        for j in range(first, n_mine):
                            c = kv + j - first
                            st = sh.k.index(c)
                            ph = sh.k.phase(c)
                            sh.k.wait_at(st, ph)
                            sh.turns.begin(turn + 2 * (j - first), WG)
                            s_tok = warpgroup_mma(q_tile, sh.k.tile(st).permute((1, 0)), s_zero,
                                                  use_acc=False, is_async=True)
                            sh.turns.end(WG)
                            s = warpgroup_mma_wait(0, deps=(s_tok,))
                            sh.k.release(st, SYNC)
                            cols = j * BLOCK_N + cols0
                            s = mod.apply(s, cols)
                            if WINDOW:
                                unmasked = (j < n_full) & (j >= full_lo)
                            else:
                                unmasked = j < n_full
                            if unmasked:
                                p, m_i, l_i, alpha = softmax(s, m_i, l_i, col_limit, cols, qk_scale, False)
                            else:
                                p, m_i, l_i, alpha = softmax(s, m_i, l_i, col_limit, cols, qk_scale, True, True,
                                                              col_start)
                            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                            p = gl.convert_layout(p.to(dtype), cfg.p_layout)
                            sh.v.wait_at(st, ph)
                            if tiles.packed.ON:
                                zero_rows_past(sh.v.tile(st), j, seqlen_k, BLOCK_N, cfg.ld_layout)
                            sh.turns.begin(turn + 2 * (j - first) + 1, WG)
                            o_tok = warpgroup_mma(p, sh.v.tile(st), acc, is_async=True)
                            sh.turns.end(WG)
                            acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
                            sh.v.release(st, SYNC)
                        sh.q.release(WG, SYNC)
                        turn += 2 * (n_blocks - first)   # (no SKIP without OVERLAP: n_mine is n_blocks)
                    if not SKIP:
                        kv += n_blocks - first
                else:
                    # No visible key block at all: every row of this warpgroup is empty (or past
                    # the end of the queries).
                    sh.q.release(WG, SYNC)
                    acc = gl.zeros([ROWS, cfg.HEAD_DIM], gl.float32, o_layout)
                    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
                    l_i = gl.zeros([ROWS], gl.float32, row_layout)
                if SKIP:
                    # The tile's key blocks [n_mine, n_blocks), which this warpgroup's rows do not
                    # see: released as they land, their ping-pong turns handed straight on. Then
                    # the ring and turn counters move past the whole tile, as for every warpgroup.
                    _pass_blocks(cfg, sh, WG, kv, turn, n_mine, n_blocks)
                    if n_blocks > 0:
                        turn += n_blocks + 1
                    kv += n_blocks

                # -- epilogue: out = acc / l, lse = m * sm_scale + ln(l); empty rows (l = 0): 0 and -inf
                # (with a sink: 0 and the sink) --
                if io.scores.HAS_SINKS:
                    acc, m_i, l_i = fold_sink(acc, m_i, l_i, io.scores.sink(off_h), io.sm_scale, qk_scale, o_layout)
                lse, inv_l = finish_rows(m_i, l_i, io.sm_scale, o_layout)
                out = (acc * inv_l[:, None]).to(dtype)
                if tiles.packed.ON:
                    gl.store(io.LSE + off_h.to(gl.int64) * io.stride_lh + q0 + rows, lse, mask=rows < seqlen_q)
                    _store_packed(cfg, io, o_tile, out, q0 + row0, off_h, seqlen_q - row0)
                else:
                    gl.store(io.LSE + pid_bh.to(gl.int64) * seqlen_q + rows, lse, mask=rows < seqlen_q)
                    # O goes out through this warpgroup's own shared-memory tile and one TMA store,
                    # which drops the rows past seqlen_q. The previous tile's store must have finished
                    # reading the tile first (store_wait is per issuing thread, so a barrier follows
                    # it); the fence orders these generic writes before the async proxy's read.
                    tma.store_wait(0)
                    gl.thread_barrier()
                    o_tile.store(out)
                    fence_async_shared()
                    tma.async_copy_shared_to_global(io.o_desc, [off_b, row0, off_h, 0], o_tile)
                n_done += 1
    tma.store_wait(0)


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------

# Sequence lengths and head counts are not specialised on (divisibility by 16, value 1): the kernel
# does not use those facts, and each specialisation would be one more compile.
@gluon.jit(do_not_specialize=["num_heads_q", "kv_group_size", "seqlen_q", "seqlen_k", "num_m_blocks",
                              "num_items", "section", "window_left", "window_right", "stride_lh"])
def _attn_fwd_hopper_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE,
    num_heads_q, kv_group_size, seqlen_q, seqlen_k, num_m_blocks, num_items, section,
    sm_scale, qk_scale,
    slope_scale, tanh_scale, softcap, ALIBI_SLOPES, stride_ab, stride_ah, SINKS,   # score variants, else None
    window_left, window_right,                                                     # a window, else None
    HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, NUM_WG: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
    ORDER: gl.constexpr, PRODUCER_REGS_: gl.constexpr, CONSUMER_REGS_: gl.constexpr,
    LTC: gl.constexpr, SKIP: gl.constexpr,
    SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False, HAS_SINKS: gl.constexpr = False,
    HAS_LEFT: gl.constexpr = False, HAS_RIGHT: gl.constexpr = False,
    CU_SEQLENS_Q=None, CU_SEQLENS_K=None, O=None, stride_ot=None, stride_oh=None, stride_lh=None,  # packed
    PACKED: gl.constexpr = False,
):
    """A program takes work items pid, pid + grid, ... of num_items; an item is one tile (BLOCK_M =
    ROWS * NUM_WG query rows of one (batch, query head)) or, ORDER == PAIRED, two (``tile_coords``). With
    grid = num_items (not persistent) that is one item per program. PACKED: packed sequences
    (``Packed``), seqlen_q / seqlen_k the longest."""
    dtype: gl.constexpr = q_desc.dtype
    cfg = FwdConfig(HEAD_DIM, ROWS, NUM_WG, BLOCK_N, STAGES, IS_CAUSAL, OVERLAP, PINGPONG, ORDER, LTC, SKIP, dtype)
    tiles = Tiles(num_items, section, num_m_blocks, num_heads_q, kv_group_size, seqlen_q, seqlen_k,
                  Window(window_left, window_right, HAS_LEFT, HAS_RIGHT), Packed(CU_SEQLENS_Q, CU_SEQLENS_K, PACKED),
                  ROWS * NUM_WG, BLOCK_N, IS_CAUSAL, ORDER)
    scores = ScoreArgs(slope_scale, tanh_scale, softcap, ALIBI_SLOPES, stride_ab, stride_ah, SINKS, SOFTCAP, ALIBI,
                       HAS_SINKS, HEAD_DIM)
    io = FwdIO(q_desc, k_desc, v_desc, o_desc, LSE, sm_scale, qk_scale, scores, O, stride_ot, stride_oh, stride_lh)

    # -- shared memory: query and output tiles, the K/V ring, barriers --
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, ROWS, HEAD_DIM], q_layout)
    o_smem = gl.allocate_shared_memory(dtype, [NUM_WG, ROWS, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    if LTC:
        # An [8, BLOCK_N] tile of ones (keys contiguous, like a K tile), read through a transposed view
        # as the [BLOCK_N, 8] B operand of the row-sum wgmma. Written once by the default warps, then
        # fenced for the async proxy that wgmma reads through.
        ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, BLOCK_N], dtype)
        ones_reg: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, gl.num_warps()], [1, 0])
        ones_smem = gl.allocate_shared_memory(dtype, [8, BLOCK_N], ones_layout,
                                              gl.full([8, BLOCK_N], 1.0, dtype, ones_reg)).permute((1, 0))
        fence_async_shared()
        gl.thread_barrier()
    else:
        ones_smem = q_smem                 # not read: a placeholder
    for w in gl.static_range(NUM_WG):
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(q_empty.index(w), count=1)
        mbarrier.init(sched.index(w), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=NUM_WG)       # every consumer warpgroup releases
        mbarrier.init(v_empty.index(s), count=NUM_WG)
    sh = FwdShared(Ring(q_smem, q_ready, q_empty, NUM_WG), o_smem, Ring(k_smem, k_ready, k_empty, STAGES),
                   Ring(v_smem, v_ready, v_empty, STAGES), Turns(sched, NUM_WG, PINGPONG), ones_smem)

    # The partitions, written out per warpgroup count (warp_specialize takes a list of literal
    # (function, arguments) pairs).
    if NUM_WG == 1:
        gl.warp_specialize([
            (_consumer, (cfg, 0, tiles, io, sh)),
            (_producer, (cfg, tiles, io, sh)),
        ], [1], [PRODUCER_REGS_])
    elif NUM_WG == 2:
        gl.warp_specialize([
            (_consumer, (cfg, 0, tiles, io, sh)),
            (_consumer, (cfg, 1, tiles, io, sh)),
            (_producer, (cfg, tiles, io, sh)),
        ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])
    else:
        gl.static_assert(NUM_WG == 3, "NUM_WG: 1, 2 or 3 consumer warpgroups")
        gl.warp_specialize([
            (_consumer, (cfg, 0, tiles, io, sh)),
            (_consumer, (cfg, 1, tiles, io, sh)),
            (_consumer, (cfg, 2, tiles, io, sh)),
            (_producer, (cfg, tiles, io, sh)),
        ], [4, 4, 1], [CONSUMER_REGS_, CONSUMER_REGS_, PRODUCER_REGS_])

# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------


ORDERS = {"plain": PLAIN.value, "paired": PAIRED.value, "snake": SNAKE.value}
# snake_section's model of the cost of reading K/V with little reuse: when the grid's CTAs run the
# tiles of h heads' K/V at once (about grid / h CTAs on each), the time grows by about
# SECTION_REUSE * h / grid (fitted on H200 timings: 4 CTAs per head ~7% slower than 33, 16 ~1%).
SECTION_REUSE = 0.3


def tile_order(causal: bool, persistent: bool, block_m: int) -> str:
    """The persistent loop's tile order (``tile_coords``): 'plain' unless causal and persistent;
    there 'paired' for 128-row tiles and 'snake' for taller ones (with ``snake_section``'s sections).

    Measured on the H200 (causal, every order forced; docs/performance.md has the tables): with
    128-row tiles snake was 5-17% slower than paired in one section at every shape but one (level
    at B16 H32 S1k), and 3-35% slower in sections of 8-128 heads but one (+3% at B16 H32 S1k, where
    the forward takes the Triton kernel). With 192-row tiles, snake in the sections ``snake_section``
    picks was level with paired or ahead at every timed shape (+22-23% at B8-16 H16 S2k), and paired
    spills 44-184 bytes causal where snake spills 0-32."""
    if not (causal and persistent):
        return "plain"
    return "paired" if block_m < 192 else "snake"


def by_cost(tile: torch.Tensor, num_m_blocks: int, num_bh: int, section: int):
    """``tile_by_cost`` on the host (the kernel's is Gluon): tile numbers -> (query block, (batch, head)
    index). ``snake_section`` models the kernel's order with it; a CPU test checks it is a
    bijection and that sections of 1 and of all heads are the plain causal and the old snake order."""
    first = (tile // (section * num_m_blocks)) * section
    size = (num_bh - first).clamp(min=1, max=section)
    r = tile - first * num_m_blocks
    return num_m_blocks - 1 - r // size, first + r % size


@functools.lru_cache(maxsize=256)
def snake_section(num_bh: int, num_m_blocks: int, block_m: int, block_n: int, seqlen_q: int,
                  seqlen_k: int, grid: int, kv_group: int = 1) -> int:
    """The snake order's section (``tile_by_cost``): how many (batch, head) pairs' tiles are sorted and
    dealt together. One section of all heads balances the CTAs' work best, but runs the heaviest
    tiles of up to ``grid`` heads at once, each read by one or two CTAs, where a smaller section
    keeps grid / section CTAs on each head's K/V while it is in L2 (B4 H32 S4k at head_dim
    64, 355.7 TFLOP/s in one section of 128 heads, 408.0 in sections of 8). So each power of two up
    to num_bh (and num_bh) is scored by its busiest CTA's work over the mean (the tiles dealt as
    the kernel deals them; a tile's work is its key blocks plus one) times 1 + SECTION_REUSE * h /
    grid, where h counts the K/V heads whose tiles run at once: the section's heads (at most
    grid) or, when a section has fewer tiles than the grid, grid / num_m_blocks, divided by ``kv_group``
    (the query heads of a GQA group read one K/V; the fit is on groups of 1, GQA picks are
    untimed). The lowest score wins, the larger section on a tie (a tie means the same balance
    and about the same heads at once; the larger ones were timed)."""
    cpu = torch.device("cpu")                        # host arithmetic whatever the default device
    m = torch.arange(num_m_blocks, device=cpu)
    hi = ((m + 1) * block_m + seqlen_k - seqlen_q).clamp(0, seqlen_k)
    cost = (hi + block_n - 1) // block_n + 1                               # per query block m
    t = torch.arange(num_m_blocks * num_bh, device=cpu)
    rounds = -(-t.numel() // grid)
    best, best_score = num_bh, None
    for section in sorted({1 << i for i in range(num_bh.bit_length())} | {num_bh}):
        heads = max(min(section, grid), grid / num_m_blocks) / kv_group   # K/V heads read at once
        reuse = 1 + SECTION_REUSE * heads / grid
        if best_score is not None and reuse > best_score:
            break              # balance >= 1 and reuse grows with the section: no later one wins
        w = cost[by_cost(t, num_m_blocks, num_bh, section)[0]]
        w = torch.cat([w, w.new_zeros(rounds * grid - w.numel())]).view(rounds, grid)
        w[1::2] = w[1::2].flip(1)                                    # odd rounds in reverse
        load = w.sum(0)
        score = float(load.max()) / float(load.float().mean()) * reuse
        if best_score is None or score <= best_score:
            best, best_score = section, score
    return best


@on_input_device
def forward_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool,
                   out: torch.Tensor | None = None, *, variant: str, order: str | None = None,
                   section: int | None = None, scores: ScoreVariant = NO_SCORES,
                   window: tuple[int, int] | None = None, varlen: Varlen | None = None):
    """``forward()``'s contract on the Hopper kernel: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D];
    returns (out [B, Sq, Hq, D] in q's dtype, lse [B, Hq, Sq] float32, natural log). ``out`` may be a
    preallocated strided view. ``variant``: a key of VARIANTS (the forward takes the one
    ``dispatch.forward_variant`` picks). ``order``: the tile order, a key of ORDERS (any of them
    gives the same result; they differ in how evenly the persistent CTAs share the causal work);
    None lets ``tile_order`` pick. ``section``: (batch, head) pairs per section of ``tile_by_cost`` for
    the causal plain and snake orders (the paired order and non-causal launches do not use it);
    None: 1 for plain, ``snake_section``'s pick for snake. ``scores``: softcap, ALiBi and sinks
    ([Note: score variants] in common.py), validated. ``window``: (left, right) as
    ``block_ranges.window_bounds`` returns it (causal folded in), or None; windowed launches walk the
    tiles in the plain order (their tiles cost about the same) and do not skip per warpgroup.
    ``varlen``: packed sequences (``common.Varlen``): q / out [total_q, Hq, D], k / v [total_k, Hkv, D],
    lse [Hq, total_q]; the grid and tile order are those of a batch of the longest sequences, whose
    tiles past a sequence's end do no work."""
    if order is not None and (not isinstance(order, str) or order not in ORDERS):
        raise ValueError(f"order must be one of {sorted(ORDERS)} or None; got order={order!r}")
    if section is not None and (not isinstance(section, int) or isinstance(section, bool) or section < 1):
        raise ValueError(f"section must be a positive int or None; got section={section!r}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    heads_q, head_dim = q.shape[-2:]
    heads_k = k.shape[-2]
    batch, seqlen_q, seqlen_k, (q, k, v, out_4d), packed = sequences(varlen, q, k, v, out)
    if varlen is not None:
        lse = torch.empty((heads_q, out.shape[0]), dtype=torch.float32, device=q.device)
        packed.update(O=out, stride_ot=out.stride(0), stride_oh=out.stride(1), stride_lh=lse.stride(0))
    else:
        lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if k.shape[1] == 0:                   # no key at all (in any sequence): every row is empty
        scores.fill_no_keys(out, lse)
        return out, lse
    cfg = variant_config(variant, head_dim)
    if cfg["ltc"] and q.dtype != torch.float16:
        raise ValueError(f"variant {variant!r} sums the rows of an fp16 P on the tensor cores and takes "
                         f"float16 inputs; got q.dtype={q.dtype}")
    q_desc = descriptor(q, cfg["rows"], head_dim)
    o_desc = descriptor(out_4d, cfg["rows"], head_dim)
    k_desc = descriptor(k, cfg["block_n"], head_dim)
    v_desc = descriptor(v, cfg["block_n"], head_dim)
    num_m_blocks = cdiv(seqlen_q, cfg["block_m"])
    num_tiles = batch * heads_q * num_m_blocks
    # Persistent: one program per SM (132 when compiling on a machine without a GPU).
    sms = sm_count(q.device) if q.is_cuda else 132
    if order is None:
        order = "plain" if window is not None else tile_order(causal, cfg["persistent"], cfg["block_m"])
    num_items = batch * heads_q * ((num_m_blocks + 1) // 2) if order == "paired" else num_tiles
    if num_items == 0:
        return out, lse                  # packed: no sequence has a query (max_seqlen_q is 0)
    grid = min(num_items, sms) if cfg["persistent"] else num_items
    if section is None:
        section = 1
        if order == "snake":
            section = snake_section(batch * heads_q, num_m_blocks, cfg["block_m"], cfg["block_n"],
                                    seqlen_q, seqlen_k, grid, heads_q // heads_k)
    section = min(section, batch * heads_q)
    # SOFTCAP: the consumers turn the scores into natural units (``Scores.apply``), so the running
    # max is in natural units: the softmax takes log2(e) (score_launch_args), the epilogue 1.
    launch.run(
        _attn_fwd_hopper_kernel, (grid,),
        q_desc=q_desc, k_desc=k_desc, v_desc=v_desc, o_desc=o_desc, LSE=lse,
        num_heads_q=heads_q, kv_group_size=heads_q // heads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        num_m_blocks=num_m_blocks, num_items=num_items, section=section,
        sm_scale=1.0 if natural_units(scores) else sm_scale, **score_launch_args(scores, sm_scale, sinks=True),
        HEAD_DIM=head_dim, ROWS=cfg["rows"], NUM_WG=cfg["num_wg"], BLOCK_N=cfg["block_n"],
        STAGES=cfg["stages"], IS_CAUSAL=causal, OVERLAP=cfg["overlap"], PINGPONG=cfg["pingpong"],
        ORDER=ORDERS[order], LTC=cfg["ltc"], SKIP=cfg["skip"] and causal and window is None,
        **window_kernel_args(window), **packed,
        PRODUCER_REGS_=PRODUCER_REGS, CONSUMER_REGS_=cfg["consumer_regs"],
        num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"],
    )
    return out, lse
