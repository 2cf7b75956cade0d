"""Pieces the Hopper (Gluon, sm_90) kernels share: the forward, backward and decode kernels import
them from here, never from each other. Aggregates of kernel state (``Ring``: slots and their
barriers; ``Tiles``: the persistent tile walk), tile orders, per-row key limits, the online-softmax
step on wgmma accumulators, operand conversion, the epilogue's normalisation, host-built TMA
descriptors and the check of what TMA accepts. The design: docs/hopper.md.

No ``from __future__ import annotations`` here: an aggregate checks its fields against its class
annotations at trace time, so they must be types, not strings.
"""

import functools

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.language.core import _aggregate as aggregate
from triton.language.core import base_value  # Triton 3.5/3.6's name (later gluon.aggregate)

from .block_ranges import (
    causal_col_limit,
    causal_key_range,
    full_key_blocks,
    window_key_range,
    window_query_range,
)
from .common import FLOAT32_MAX, LOG2E
from .launch import tma_compatible

# Tile orders of the persistent loop (``tile_coords``; forward_hopper.tile_order picks one).
PLAIN = gl.constexpr(0)
PAIRED = gl.constexpr(1)
SNAKE = gl.constexpr(2)

PRODUCER_REGS = 24          # setmaxnreg of the producer's warpgroup (the minimum)
REGISTER_FILE = 65536       # 32-bit registers per SM (and the most one CTA may use)
GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# The type of an aggregate field holding a scalar kernel argument: a runtime value, or the constant a
# launch specialised it to (an int argument equal to 1 that is not in do_not_specialize).
SCALAR = (gl.tensor, gl.constexpr)
FLOAT32_MAX_K = gl.constexpr(FLOAT32_MAX)
SMEM = gl.shared_memory_descriptor


@gluon.constexpr_function
def constexprs(obj, **values):
    """Set an aggregate's fields in its ``__init__`` (a constexpr_function, run at trace time with
    constexpr arguments unwrapped): Triton values as they are, anything else as a constexpr."""
    for name, value in values.items():
        setattr(obj, name, value if isinstance(value, base_value) else gl.constexpr(value))


@aggregate
class Ring:
    """``SLOTS`` shared-memory slots (``mem``, [SLOTS, ...]) that a producer fills by TMA and consumers
    read, each with a *ready* barrier (the producer arms it, TMA completes it) and an *empty* one (the
    consumers arrive once they are done with the slot); docs/hopper.md#rings-and-barriers. Tile c of
    the ring, counted over all of a CTA's work, takes slot c % SLOTS on its use k = c // SLOTS:
    consumers wait for parity k & 1 on ready, the producer for (k & 1) ^ 1 on empty, which a fresh
    barrier passes at once (the first SLOTS fills need no release)."""
    mem: SMEM
    ready: SMEM
    empty: SMEM
    SLOTS: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, mem, ready, empty, SLOTS):
        constexprs(self, mem=mem, ready=ready, empty=empty, SLOTS=SLOTS)

    @gluon.jit
    def index(self, c):
        """Tile c's slot."""
        return c % self.SLOTS

    @gluon.jit
    def phase(self, c):
        """The parity the consumers wait for on tile c's ready barrier (the producer: its opposite)."""
        return (c // self.SLOTS) & 1

    @gluon.jit
    def tile(self, s):
        return self.mem.index(s)

    @gluon.jit
    def acquire(self, c):
        """Producer: wait until tile c's slot is free."""
        mbarrier.wait(self.empty.index(c % self.SLOTS), ((c // self.SLOTS) & 1) ^ 1)

    @gluon.jit
    def acquire_at(self, s, empty_phase):
        """Producer: ``acquire`` with the slot and parity (``phase(c) ^ 1``) already at hand."""
        mbarrier.wait(self.empty.index(s), empty_phase)

    @gluon.jit
    def fill(self, desc, coords, s):
        """Producer: one TMA box of ``desc`` at ``coords`` into slot s, completing its ready barrier."""
        self.expect(s, desc.block_type.nbytes)
        self.load(desc, coords, s)

    @gluon.jit
    def expect(self, s, nbytes):
        """Producer: arm slot s's ready barrier for ``nbytes`` bytes of TMA copies."""
        mbarrier.expect(self.ready.index(s), nbytes)

    @gluon.jit
    def load(self, desc, coords, s):
        """Producer: a TMA box of ``desc`` at ``coords`` into slot s (after ``expect``)."""
        tma.async_copy_global_to_shared(desc, coords, self.ready.index(s), self.mem.index(s))

    @gluon.jit
    def wait(self, c, pred=True):
        """Consumer: wait until tile c has landed."""
        mbarrier.wait(self.ready.index(c % self.SLOTS), (c // self.SLOTS) & 1, pred=pred)

    @gluon.jit
    def wait_at(self, s, phase):
        """Consumer: ``wait`` with the slot and phase already at hand."""
        mbarrier.wait(self.ready.index(s), phase)

    @gluon.jit
    def empty_bar(self, s):
        return self.empty.index(s)

    @gluon.jit
    def release(self, s, SYNC: gl.constexpr = False, pred=True):
        """Consumer: slot s has been read (SYNC: see ``release``)."""
        if SYNC:
            gl.thread_barrier()
        mbarrier.arrive(self.empty.index(s), count=1, pred=pred)


@gluon.jit
def release(bar, SYNC: gl.constexpr = False):
    """Arrive on an empty barrier: a consumer has read its slot. SYNC (a consumer partition of several
    warpgroups): wgmma waits are per warpgroup and the arrive is done once, so first make sure every
    warp of the partition is past its wait."""
    if SYNC:
        gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@aggregate
class Window:
    """A launch's local window (``block_ranges.window_key_range``'s rule: query i sees key j when
    i + off - left <= j (HAS_LEFT) and j <= i + off + right (HAS_RIGHT), off = seqlen_k - seqlen_q;
    causal folded in as right = 0). ON: either bound is set. Without a window (ON False) the bounds
    are None: nothing is compiled in, and the kernels take their causal / full paths."""
    left: SCALAR
    right: SCALAR
    HAS_LEFT: gl.constexpr
    HAS_RIGHT: gl.constexpr
    ON: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, left, right, HAS_LEFT, HAS_RIGHT):
        constexprs(self, left=left, right=right, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
                   ON=bool(HAS_LEFT) or bool(HAS_RIGHT))

    @gluon.jit
    def key_blocks(self, start_m, seqlen_q, seqlen_k, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
        """The query rows [start_m, start_m + ROWS)'s key blocks: (first, full_lo, full_hi, end).
        Blocks [first, end) hold every key a row sees (none outside is loaded); [full_lo, full_hi)
        are seen in full by every row (no mask), the others need the element mask."""
        lo, mid_lo, mid_hi, hi = window_key_range(start_m, seqlen_q, seqlen_k, self.left, self.right, ROWS,
                                                  BLOCK_N, self.HAS_LEFT, self.HAS_RIGHT)
        return lo // BLOCK_N, mid_lo // BLOCK_N, mid_hi // BLOCK_N, gl.cdiv(hi, BLOCK_N)

    @gluon.jit
    def query_rows(self, start_n, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, KEYS: gl.constexpr):
        """The transpose, for the keys [start_n, start_n + KEYS) (the backward's walk over query
        blocks): (lo, full_lo, full_hi, hi) query rows, ``block_ranges.window_query_range``."""
        return window_query_range(start_n, seqlen_q, seqlen_k, self.left, self.right, BLOCK_M, KEYS,
                                  self.HAS_LEFT, self.HAS_RIGHT)

    @gluon.jit
    def first_query(self, keys, causal_offset, seqlen_k):
        """For key positions ``keys`` (the backward's transposed tiles): the first query that sees each,
        the window's rule turned round (query i sees key j when j - off - right <= i <= j - off + left).
        A key past seqlen_k is seen by no query (first query past any). int32 per key row, so the
        element mask is 32-bit compares (``block_ranges.window_visible`` compares in int64)."""
        if self.HAS_RIGHT:
            q_first = keys - (causal_offset + self.right)
        else:
            q_first = gl.full_like(keys, 0)
        return gl.where(keys < seqlen_k, q_first, 2**31 - 1)

    @gluon.jit
    def last_query(self, keys, causal_offset):
        """The last query that sees each key of ``keys`` (HAS_LEFT only: without a left bound every
        query from ``first_query`` on sees the key)."""
        return keys + (self.left - causal_offset)

    @gluon.jit
    def row_limits(self, row0, rows, causal_offset, seqlen_k, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
        """``sm90_common.row_limits`` under the window: (full_lo, full_hi, col_limit). Key blocks
        [full_lo, full_hi) are seen in full by every row of ``rows`` (first row row0); row i sees the
        keys before col_limit[i] and (HAS_LEFT) from ``col_start`` on. (Gluon functions cannot return
        None inside a tuple: the left edge has its own method, called under HAS_LEFT.)"""
        _, full_lo, full_hi, _ = self.key_blocks(row0, seqlen_k - causal_offset, seqlen_k, ROWS, BLOCK_N)
        return full_lo, full_hi, self.col_limit(rows, causal_offset, seqlen_k)

    @gluon.jit
    def col_limit(self, rows, causal_offset, end):
        """One past the last key each row of ``rows`` sees: its right edge + 1 (HAS_RIGHT), at most
        ``end``."""
        if self.HAS_RIGHT:
            return gl.minimum(rows + (causal_offset + self.right + 1), end)
        else:
            return gl.full_like(rows, 0) + end

    @gluon.jit
    def col_start(self, rows, causal_offset, floor=None):
        """The first key each row of ``rows`` sees (HAS_LEFT only). ``floor`` (the decode kernel: minus
        its query count): the offset taken in int64 and kept at or above it, so a bound near 2^31 (a
        decode cache whose lengths are not checked) cannot wrap; below it every row's edge is before
        key 0 anyway."""
        if floor is None:
            return rows + (causal_offset - self.left)
        else:
            return rows + gl.maximum(causal_offset.to(gl.int64) - self.left, floor).to(gl.int32)


@aggregate
class Packed:
    """Where each batch entry's sequence lies in the kernel's tensors. Dense (ON False): batch entry b
    is index b of the descriptors' batch dimension, every sequence seqlen_q queries and seqlen_k keys
    long. Packed sequences (ON; ``flash_attn_varlen_func``): the tensors are [1, total, H, D] views of
    the packed ones, sequence b owns rows cu_q[b] .. cu_q[b + 1] - 1 of q and out (columns of the
    [Hq, total_q] lse) and cu_k[b] .. cu_k[b + 1] - 1 of k and v, and seqlen_q / seqlen_k are the
    longest lengths (which size the grid). A TMA box that runs past a sequence's end reads the next
    one's rows: their scores are masked like keys past seqlen_k, the V rows are zeroed before P V
    (``zero_tail``), and the output rows past the end are not written (the forward's
    ``_store_packed``)."""
    cu_q: SCALAR
    cu_k: SCALAR
    ON: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, cu_q, cu_k, ON):
        constexprs(self, cu_q=cu_q, cu_k=cu_k, ON=ON)

    @gluon.jit
    def batch_index(self, off_b):
        """The descriptors' batch index of batch entry off_b: 0 for packed sequences."""
        if self.ON:
            return 0
        else:
            return off_b

    @gluon.jit
    def sequence(self, off_b, valid):
        """Batch entry off_b's (first query row, first key row, seqlen_q, seqlen_k) in the packed
        tensors (ON only; an entry that is not ``valid`` reads nothing and is empty). The Gluon
        counterpart of ``block_ranges.sequence_bounds``: int32 (TMA coordinates), masked."""
        q0 = gl.load(self.cu_q + off_b, mask=valid, other=0)
        q1 = gl.load(self.cu_q + off_b + 1, mask=valid, other=0)
        k0 = gl.load(self.cu_k + off_b, mask=valid, other=0)
        k1 = gl.load(self.cu_k + off_b + 1, mask=valid, other=0)
        return q0, k0, q1 - q0, k1 - k0


@aggregate
class Tiles:
    """The persistent tile walk (``tile_coords``): a program takes work items pid, pid + grid, ...
    below ``bound()``, each one tile or (PAIRED) two. Every partition walks it with the same fields.
    ``packed``: the sequences' layout (``Packed``)."""
    num_items: SCALAR
    section: SCALAR
    num_m_blocks: SCALAR
    num_heads_q: SCALAR
    kv_group_size: SCALAR
    seqlen_q: SCALAR
    seqlen_k: SCALAR
    window: Window
    packed: Packed
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    IS_CAUSAL: gl.constexpr
    ORDER: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, num_items, section, num_m_blocks, num_heads_q, kv_group_size, seqlen_q, seqlen_k, window,
                 packed, BLOCK_M, BLOCK_N, IS_CAUSAL, ORDER):
        self.window = window
        self.packed = packed
        constexprs(self, num_items=num_items, section=section, num_m_blocks=num_m_blocks, num_heads_q=num_heads_q,
                   kv_group_size=kv_group_size, seqlen_q=seqlen_q, seqlen_k=seqlen_k, BLOCK_M=BLOCK_M,
                   BLOCK_N=BLOCK_N, IS_CAUSAL=IS_CAUSAL, ORDER=ORDER)

    @gluon.jit
    def bound(self):
        """The end of a program's item loop. SNAKE: num_items rounded up to whole rounds of grid
        items, so every program walks the same rounds (the last one's overhang is not valid)."""
        if self.ORDER == SNAKE:
            grid = gl.num_programs(0)
            return gl.cdiv(self.num_items, grid) * grid
        else:
            return self.num_items

    @gluon.jit
    def coords(self, item, half):
        """``tile_coords`` of (item, half): (pid_bh, batch, query head, kv head, first query row, first
        and end key block to visit, valid)."""
        return tile_coords(item, half, self.num_m_blocks, self.num_heads_q, self.kv_group_size, self.seqlen_q,
                           self.seqlen_k, self.num_items, self.section, self.window, self.BLOCK_M, self.BLOCK_N,
                           self.IS_CAUSAL, self.ORDER)

    @gluon.jit
    def walk(self, item, half):
        """The tile of (item, half) as every partition sees it, so that producer and consumers walk the
        same tiles and key blocks: (pid_bh, batch, query head, kv head, first query row, first and end
        key block, valid, q0, k0, seqlen_q, seqlen_k). Dense: ``coords``, q0 = k0 = 0 and the
        launch's lengths. Packed (``packed.ON``): query rows and key blocks count from the tile's
        sequence, which starts at row q0 of q and k0 of k / v and has its own lengths; a tile past its
        sequence's end (the grid is sized by the longest one) is not valid."""
        if self.packed.ON:
            pid_m, pid_bh, valid = tile_index(item, half, self.num_m_blocks, self.num_items, self.section,
                                              self.IS_CAUSAL, self.ORDER)
            off_b = pid_bh // self.num_heads_q
            off_h = pid_bh % self.num_heads_q
            start_m = pid_m * self.BLOCK_M
            q0, k0, seqlen_q, seqlen_k = self.packed.sequence(off_b, valid)
            valid = valid & (start_m < seqlen_q)
            first, n_blocks = tile_key_blocks(start_m, seqlen_q, seqlen_k, self.window, self.BLOCK_M,
                                              self.BLOCK_N, self.IS_CAUSAL)
            return pid_bh, off_b, off_h, off_h // self.kv_group_size, start_m, first, n_blocks, valid, q0, k0, \
                seqlen_q, seqlen_k
        else:
            pid_bh, off_b, off_h, off_hk, start_m, first, n_blocks, valid = self.coords(item, half)
            return pid_bh, off_b, off_h, off_hk, start_m, first, n_blocks, valid, 0, 0, self.seqlen_q, self.seqlen_k


@gluon.jit
def tile_by_cost(tile, num_m_blocks, num_bh, section):
    """Tile number -> (query block, (batch, head) index) in the order of decreasing cost within
    sections of ``section`` (batch, head) pairs: section 0's heads first, within it the query blocks
    from the last (the heaviest, causal) and the heads fastest; the last section may be smaller.
    section = 1: one head after the other; section = num_bh: all heads' heaviest blocks first.
    A tile number past the last (SNAKE's overhang, not valid) maps out of range: nothing reads it."""
    first = (tile // (section * num_m_blocks)) * section              # the section's first head
    size = gl.maximum(gl.minimum(section, num_bh - first), 1)         # (>= 1 past the last tile)
    r = tile - first * num_m_blocks                                   # position within the section
    return num_m_blocks - 1 - r // size, first + r % size


@gluon.jit
def tile_coords(item, half, num_m_blocks, num_heads_q, kv_group_size, seqlen_q, seqlen_k, num_items,
                 section, window, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr,
                 ORDER: gl.constexpr):
    """Work item (and half of it) -> (pid_bh, batch, query head, kv head, first query row, first key
    block, end key block, valid). The key blocks are [first, end): without a window first = 0 (a
    constant) and none above the last row's causal diagonal (``block_ranges.causal_key_range``); with
    one (``Window``) those of the rows' windows.
    Every partition calls this with the same arguments, so they all walk the same blocks.

    ORDER (host side: ``tile_order``), num_items tiles or items:
    * PLAIN: item = tile. Query blocks vary fastest (neighbouring tiles share K/V in L2). Causal:
      by cost within sections of ``section`` heads (``tile_by_cost``): the heaviest (last) query
      blocks of a section's heads first.
    * PAIRED (causal, persistent): an item is two query blocks of one head, m = M - 1 - p (half 0)
      and m = p (half 1), whose key-block counts add up to about the same total for every p (exactly
      when BLOCK_M is a multiple of BLOCK_N). So every item costs about the same, the persistent
      CTAs stay in step, and the tiles in flight at any moment stay neighbours (their K/V stays in
      L2). With M odd the middle block pairs with itself: its half 1 is not valid. The CTAs do
      whole items, so with N items the last round has N mod grid.
    * SNAKE (causal, persistent): tiles sorted by cost within sections of ``section`` heads
      (``tile_by_cost``; one section: query block m from the last, the heads fastest) and dealt in
      rounds of grid tiles, the even rounds to programs 0, 1, ..., the odd
      ones in reverse: a program that took a heavy tile in one round takes a light one in the next.
      The loads even out to within a fraction of a tile (longest-processing-time scheduling, up to
      the ties), where PAIRED leaves the last round's remainder of whole items."""
    pid_m, pid_bh, valid = tile_index(item, half, num_m_blocks, num_items, section, IS_CAUSAL, ORDER)
    off_b = pid_bh // num_heads_q
    off_h = pid_bh % num_heads_q
    off_hk = off_h // kv_group_size
    start_m = pid_m * BLOCK_M
    first, n_blocks = tile_key_blocks(start_m, seqlen_q, seqlen_k, window, BLOCK_M, BLOCK_N, IS_CAUSAL)
    return pid_bh, off_b, off_h, off_hk, start_m, first, n_blocks, valid


@gluon.jit
def tile_index(item, half, num_m_blocks, num_items, section, IS_CAUSAL: gl.constexpr, ORDER: gl.constexpr):
    """``tile_coords``' walk: work item (and half of it) -> (query block, (batch, head) index, valid)."""
    if ORDER == PAIRED:
        half_m = (num_m_blocks + 1) // 2
        pid_bh = item // half_m
        p = item % half_m
        pid_m = p + (1 - half) * (num_m_blocks - 1 - 2 * p)
        valid = (half == 0) | (2 * p != num_m_blocks - 1)
    elif ORDER == SNAKE:
        grid = gl.num_programs(0)
        rnd = item // grid
        slot = item % grid
        slot = slot + (rnd % 2) * (grid - 1 - 2 * slot)       # odd rounds: programs in reverse
        tile = rnd * grid + slot
        valid = tile < num_items
        pid_m, pid_bh = tile_by_cost(tile, num_m_blocks, num_items // num_m_blocks, section)
    elif IS_CAUSAL:
        pid_m, pid_bh = tile_by_cost(item, num_m_blocks, num_items // num_m_blocks, section)
        valid = True
    else:
        pid_m = item % num_m_blocks
        pid_bh = item // num_m_blocks
        valid = True
    return pid_m, pid_bh, valid


@gluon.jit
def tile_key_blocks(start_m, seqlen_q, seqlen_k, window, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    IS_CAUSAL: gl.constexpr):
    """The query rows [start_m, start_m + BLOCK_M)'s key blocks [first, end): without a window
    first = 0 (a constant) and none above the last row's causal diagonal; with one the window's."""
    if window.ON:
        first, _, _, n_blocks = window.key_blocks(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N)
    else:
        first = 0
        _, hi = causal_key_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
        n_blocks = gl.cdiv(hi, BLOCK_N)
    return first, n_blocks


@gluon.jit
def row_limits(row0, rows, causal_offset, seqlen_k, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                IS_CAUSAL: gl.constexpr, row_layout: gl.constexpr):
    """For query rows ``rows`` (the first is row0): (n_full, col_limit). Key blocks [0, n_full) are
    seen in full by every row (no mask: ``block_ranges.full_key_blocks``); row i sees keys <
    col_limit[i] (the end of the keys, or its causal diagonal + 1, bottom-right aligned:
    causal_offset = seqlen_k - seqlen_q). The forward's
    consumers and the backward's dQ consumers use it."""
    n_full = full_key_blocks(row0, seqlen_k - causal_offset, seqlen_k, BLOCK_N, IS_CAUSAL)
    if IS_CAUSAL:
        col_limit = gl.minimum(causal_col_limit(rows, causal_offset), seqlen_k)
    else:
        col_limit = gl.full([ROWS], 0, gl.int32, row_layout) + seqlen_k
    return n_full, col_limit


@gluon.jit
def seen_cols(cols, col_limit, col_start=None):
    """The [ROWS, BN] mask of the key columns ``cols`` each row sees: those below its col_limit and,
    with ``col_start`` (a window's left edge), from col_start on."""
    seen = cols[None, :] < col_limit[:, None]
    if col_start is not None:
        seen = seen & (cols[None, :] >= col_start[:, None])
    return seen


@gluon.jit
def softmax(s, m_i, l_i, col_limit, cols, qk_scale, MASK: gl.constexpr, SUM: gl.constexpr = True,
            col_start=None):
    """Fold one tile of raw scores s [ROWS, BN] into the running (m, l). Returns (p fp32, m_new,
    l_new, alpha). MASK: scores at columns >= col_limit (a per-row bound: the end of the keys, the
    causal diagonal or a window's right edge) become -inf, and with ``col_start`` (a window's left
    edge) those below it. Rows that have seen no key keep m = -inf, l = 0 and give p = 0, alpha = 1
    (never NaN)."""
    if MASK:
        if col_start is None:      # (written out: through seen_cols ptxas schedules the plain kernels differently)
            s = gl.where(cols[None, :] < col_limit[:, None], s, float("-inf"))
        else:
            s = gl.where(seen_cols(cols, col_limit, col_start), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    # One FMA per score: s * qk_scale - m * qk_scale, then the hardware exp2.
    p = gl.exp2(s * qk_scale - (m_safe * qk_scale)[:, None])
    alpha = gl.exp2(gl.where(m_new == float("-inf"), 0.0, (m_i - m_new) * qk_scale))
    if SUM:
        l_new = l_i * alpha + gl.sum(p, 1)
    else:
        l_new = l_i                      # LTC: the row sums come from the tensor cores instead
    return p, m_new, l_new, alpha


@gluon.jit
def finish_rows(m_i, l_i, sm_scale, o_layout: gl.constexpr):
    """The epilogue's row statistics: (lse = m * sm_scale + ln(l), 1 / l in O's row layout). A row
    that saw no key (l = 0) gets lse = -inf and 1 / l = 1, so its out (acc = 0) is 0, never NaN.
    The forward's and the decode kernel's consumers use it."""
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), m_i * sm_scale + gl.log(l_safe))
    return lse, gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))


@gluon.constexpr_function
def alibi_f32_distance(head_dim) -> bool:
    """Whether the Gluon kernels form ALiBi's distance in fp32 (``Scores.apply_grad``): at head dim
    64, where it measured faster in the forward and cut the dK/dV kernel's spills by four; not at
    128, where the integer form's forward measured faster (docs/performance.md, "ALiBi: the distance
    in fp32, raw units")."""
    return int(getattr(head_dim, "value", head_dim)) == 64


@aggregate
class Scores:
    """The score variants of a consumer's tile ([Note: score variants] in common.py): ``apply`` turns
    raw wgmma scores into the ones the softmax takes. SOFTCAP caps them into natural units (the
    launch then passes the online softmax qk_scale = log2(e) and the epilogue a scale of 1); ALIBI
    subtracts the position bias, in the scores' units: natural with SOFTCAP, else raw, the slope then
    divided by sm_scale (``ScoreArgs.tile``) so that the softmax and the epilogue take sm_scale as the
    plain kernel does. With both flags off ``apply`` returns the scores as they are: the plain kernel.
    ``rows``: the tile's query positions (row layout), ``off`` = seqlen_k - seqlen_q, ``slope``: the
    tile's (batch, head) ALiBi slope in the scores' units, or [ROWS, 1] slopes, one per row
    (``ScoreArgs.tile`` with PER_ROW); fields a flag does not use are None. F32_DIST: how ALiBi's
    distance is formed (``apply_grad``)."""
    tanh_scale: SCALAR
    softcap: SCALAR
    slope: SCALAR
    rows: SCALAR
    off: SCALAR
    SOFTCAP: gl.constexpr
    ALIBI: gl.constexpr
    F32_DIST: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, tanh_scale, softcap, slope, rows, off, SOFTCAP, ALIBI, F32_DIST):
        constexprs(self, tanh_scale=tanh_scale, softcap=softcap, slope=slope, rows=rows, off=off, SOFTCAP=SOFTCAP,
                   ALIBI=ALIBI, F32_DIST=F32_DIST)

    @gluon.jit
    def apply(self, s, cols):
        """Raw scores s [ROWS, BN] of key positions ``cols`` -> the scores the softmax takes."""
        return self.apply_grad(s, cols)[0]

    @gluon.jit
    def apply_grad(self, s, cols):
        """``apply``, and the factor the chain rule puts on dS: 1 - tanh^2 with SOFTCAP, else 1 (which
        a caller without SOFTCAP does not use). A backward's transposed tile [keys, queries] passes its
        key positions as ``rows``, the query positions as ``cols`` and -off: |k - off - q| = |q + off - k|.
        ALiBi's distance, F32_DIST: in fp32, the row and the column positions each converted before
        they are broadcast, one add per score (exact: whole numbers below 2^24); else an integer
        subtract, abs and conversion per score. The two give the same floats; which is faster
        depends on the kernel's registers (``alibi_f32_distance``)."""
        g = gl.full_like(s, 1.0)
        if self.SOFTCAP:
            t = fast_tanh(s * self.tanh_scale)
            s = self.softcap * t
            g = 1.0 - t * t
        if self.ALIBI:
            if self.F32_DIST:
                d = gl.abs((self.rows + self.off).to(gl.float32)[:, None] - cols.to(gl.float32)[None, :])
            else:
                d = gl.abs(self.rows[:, None] + self.off - cols[None, :]).to(gl.float32)
            s = s - self.slope * d
        return s, g


@aggregate
class ScoreArgs:
    """A launch's score-variant arguments ([Note: score variants] in common.py): the flags (each
    compiled in only when set) and the values behind them, None where a flag is off (``slope_scale``:
    ALIBI without SOFTCAP, 1 / sm_scale, the slope's factor into raw units). ``tile`` gives a tile's
    ``Scores``; F32_DIST: ``Scores.apply_grad``'s, ``alibi_f32_distance`` of the kernel's head dim."""
    slope_scale: SCALAR
    tanh_scale: SCALAR
    softcap: SCALAR
    SLOPES: SCALAR
    stride_ab: SCALAR
    stride_ah: SCALAR
    SINKS: SCALAR
    SOFTCAP: gl.constexpr
    ALIBI: gl.constexpr
    HAS_SINKS: gl.constexpr
    F32_DIST: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, slope_scale, tanh_scale, softcap, SLOPES, stride_ab, stride_ah, SINKS, SOFTCAP, ALIBI,
                 HAS_SINKS, HEAD_DIM):
        constexprs(self, slope_scale=slope_scale, tanh_scale=tanh_scale, softcap=softcap, SLOPES=SLOPES,
                   stride_ab=stride_ab, stride_ah=stride_ah, SINKS=SINKS, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
                   HAS_SINKS=HAS_SINKS, F32_DIST=alibi_f32_distance(HEAD_DIM))

    @gluon.jit
    def tile(self, off_b, off_h, rows, off, PER_ROW: gl.constexpr = False):
        """The ``Scores`` of batch off_b, query head off_h, query positions ``rows`` (a backward's
        transposed tile: its key positions, and -off). PER_ROW: the tile's rows belong to several
        query heads (the decode kernel packs a KV head's query heads into one tile), ``off_h`` holds
        each row's, and each row gets its own head's slope."""
        if self.ALIBI:
            slope = gl.load(self.SLOPES + off_b * self.stride_ab + off_h * self.stride_ah)
            if not self.SOFTCAP:
                # Raw units. A slope too large for them (inf) would give inf * 0 = NaN on the
                # diagonal: capped at the largest float, which masks every other key as inf would.
                slope = gl.minimum(slope * self.slope_scale, FLOAT32_MAX_K)
            if PER_ROW:
                slope = slope[:, None]
            return Scores(self.tanh_scale, self.softcap, slope, rows, off, self.SOFTCAP, self.ALIBI, self.F32_DIST)
        else:
            return Scores(self.tanh_scale, self.softcap, None, None, off, self.SOFTCAP, self.ALIBI, self.F32_DIST)

    @gluon.jit
    def sink(self, off_h):
        """Query head off_h's sink logit (HAS_SINKS); a tensor of heads gives each one's."""
        return gl.load(self.SINKS + off_h)


@gluon.jit
def fast_tanh(x):
    """tanh(x) of fp32 x by the hardware's tanh.approx.f32: one MUFU operation (the formula through
    exp2 and a division took two, libdevice's a long polynomial). Relative error below 2^-10.9, the
    size of the fp16 rounding the scores already carry (these kernels take fp16/bf16 only); the
    Triton kernels use the same instruction for fp16/bf16 (common.tanh), so a backward recomputes the
    forward's scores. Saturates to +-1, never NaN."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def fold_sink(acc, m_i, l_i, sink, sm_scale, qk_scale, o_layout: gl.constexpr):
    """Fold a sink logit (natural units) into a warpgroup's final softmax state, whose m_i is in units
    of ``sm_scale`` (qk_scale = sm_scale * log2(e)): one more term in the sum, none in acc. A row that
    saw no key gets l = 1 at m = sink: out 0, lse the sink. A sink of -inf adds nothing. Returns
    (acc, m, l)."""
    sink_m = sink / sm_scale
    m_new = gl.maximum(m_i, sink_m)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2((m_i - m_safe) * qk_scale)
    l_new = l_i * alpha + gl.exp2((sink_m - m_safe) * qk_scale)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return acc, m_new, l_new


@gluon.jit
def zero_tail(tile, start, hi, N: gl.constexpr, CHUNK: gl.constexpr, ld_layout: gl.constexpr):
    """Zero the rows of a landed V tile ([N, D] in a ring slot) whose keys (start + row) are at or past
    ``hi``. P is 0 there, but a TMA box past a sequence's end reads whatever lies there (a cache from
    torch.empty, the next packed sequence) and 0 * NaN is NaN on the tensor cores. In pieces of CHUNK
    rows (CHUNK * D / 128 values per thread), only those that hold such rows; warpgroups that share the
    slot may zero it at once (each writes the same values). The caller fences for wgmma's reads."""
    for r in gl.static_range(0, N, CHUNK):
        if start + (r + CHUNK) > hi:
            part = tile.slice(r, CHUNK)
            keys = start + r + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, ld_layout))
            v = part.load(ld_layout)
            part.store(gl.where((keys < hi)[:, None], v, gl.zeros_like(v)))


@gluon.jit
def zero_rows_past(tile, j, end, N: gl.constexpr, ld_layout: gl.constexpr, other=None):
    """Packed sequences: when block j of N rows (a landed ring slot, and ``other``, a second slot of
    the same rows) reaches past ``end``, the sequence's end, zero those rows (``zero_tail``, pieces of
    16 rows) and make the writes visible to wgmma. They are the next sequence's rows, in a product's
    reduction dimension: their p or dS is 0, but 0 * NaN is NaN."""
    if (j + 1) * N > end:
        zero_tail(tile, j * N, end, N, 16, ld_layout)
        if other is not None:
            zero_tail(other, j * N, end, N, 16, ld_layout)
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def to_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr):
    """fp32 P -> the 16-bit wgmma A operand, two values per instruction into one register
    (cvt.rn.{f16,bf16}x2.f32). With the plain ``p.to(dtype)`` the split-loop schedule's loop-carried P
    came out of ptxas with its halves swapped and 32 PRMTs per step to swap them back."""
    if dtype == gl.float16:
        h = gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [p], dtype=gl.float16,
                                      is_pure=True, pack=2)
    else:
        h = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [p], dtype=gl.bfloat16,
                                      is_pure=True, pack=2)
    return gl.convert_layout(h, p_layout)


def natural_units(scores) -> bool:
    """Whether a Gluon kernel's scores are in natural units (softcap: ``Scores``), not raw ones."""
    return scores.softcap > 0


def score_launch_args(scores, sm_scale: float, sinks: bool) -> dict:
    """A Gluon launch's score-variant arguments (``ScoreArgs``' values and flags, None / False where
    unused, so the plain kernels get none) and the online softmax's ``qk_scale``: log2(e) where softcap
    puts the scores in natural units, else sm_scale * log2(e) (ALiBi alone: raw units, slope_scale =
    1 / sm_scale). ``sinks``: the kernel takes SINKS / HAS_SINKS (the forward; the backward reads
    sinks only through the LSE)."""
    args = scores.transform_kwargs(sm_scale)
    natural = natural_units(scores)
    args.update(qk_scale=LOG2E if natural else sm_scale * LOG2E,
                slope_scale=1.0 / sm_scale if args["ALIBI"] and not natural else None)
    if sinks:
        args.update(scores.sink_kwargs())
    return args


def sequences(varlen, q: torch.Tensor, k: torch.Tensor, *others: torch.Tensor):
    """A call as the Gluon kernels take it: (batch, seqlen_q, seqlen_k, (q, k, *others) as [B, S, H, D]
    views, the launch's packed-sequence arguments). Dense (``varlen`` None): the tensors as they are,
    their lengths, no arguments. Packed sequences (``common.Varlen``; q-like [total_q, H, D], k-like
    [total_k, H, D]): [1, total, H, D] views, the longest sequence's lengths (they size the grid) and
    CU_SEQLENS_Q / CU_SEQLENS_K / PACKED for ``Packed``."""
    tensors = (q, k, *others)
    if varlen is None:
        return q.shape[0], q.shape[1], k.shape[1], tensors, {}
    return (varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k, tuple(t.unsqueeze(0) for t in tensors),
            dict(CU_SEQLENS_Q=varlen.cu_seqlens_q, CU_SEQLENS_K=varlen.cu_seqlens_k, PACKED=True))


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Global box of ``tensor_desc`` at ``coord`` += shared-memory tile ``src`` (TMA reduce-add,
    ``cp.reduce.async.bulk.tensor``; L2 does the adds). Gluon 3.6 binds the op but exports no wrapper.
    Completion is tracked like a TMA store's (``tma.store_wait``); the writing threads must
    ``fence_async_shared`` between storing ``src`` and this."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@functools.cache
def shared_layout(block_shape: tuple[int, ...], dtype) -> gl.NVMMASharedLayout:
    """The swizzled shared-memory layout of a TMA box, made once per (box, dtype): Gluon's
    ``get_default_for`` costs ~10 us of host time per call, a sixth of a short forward's launch path
    (docs/performance-notes.md#host-cost-per-call). Layouts are frozen dataclasses, safe to share."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)


def descriptor(t: torch.Tensor, rows: int, cols: int) -> GluonTensorDescriptor:
    """Host-built 4-D [B, S, H, D] descriptor moving [1, rows, 1, cols] boxes (one (batch, head)'s
    block of rows; cols is D, or for the decode kernel 64 of its columns), 128-byte swizzled like the
    kernels' shared-memory tiles. Built without the dataclass's re-validation (``tma_supported`` already
    checked what TMA needs): host time per call matters at short sequences."""
    layout = shared_layout((1, rows, 1, cols), GL_DTYPES[t.dtype])
    desc = object.__new__(GluonTensorDescriptor)
    desc.base, desc.shape, desc.strides = t, list(t.shape), list(t.stride())
    desc.block_shape, desc.layout, desc.padding = [1, rows, 1, cols], layout, "zero"
    return desc


def tma_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """True when this Hopper path handles the inputs: CUDA fp16/bf16 [B, S, H, D] views, head_dim 64
    or 128, same dtype everywhere, Hq a multiple of Hkv, TMA-compatible strides (``tma_compatible``)."""
    tensors = (q, k, v) if out is None else (q, k, v, out)
    if any(t.dim() != 4 or not t.is_cuda or t.dtype != q.dtype for t in tensors):
        return False
    if q.dtype not in GL_DTYPES:
        return False
    b, sq, hq, d = q.shape
    if d not in (64, 128) or k.shape[-1] != d or v.shape != k.shape or k.shape[0] != b:
        return False
    if k.shape[2] == 0 or hq % k.shape[2]:
        return False
    if out is not None and tuple(out.shape) != tuple(q.shape):
        return False
    return tma_compatible(*tensors)
