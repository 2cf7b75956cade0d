"""Block ranges: which key blocks a query tile sees, and which query rows a key block is seen by.

Every kernel walks its tiles through these functions, so each visibility rule is written once:

* causal (bottom-right aligned: query i sees key j when j <= i + seqlen_k - seqlen_q), forward
  walk (``causal_key_range``: key blocks of a query tile) and backward walk (``causal_query_range``:
  query rows of a key block), the element mask ``causal_mask`` (per-row bound:
  ``causal_col_limit``), and the pieces the Gluon kernels count in blocks (``full_key_blocks``,
  ``first_full_query_block``, ``causal_key_end``);
* local windows (query i sees key j when i + off - left <= j <= i + off + right): ``window_bounds``
  folds a window into the plain paths where it reaches every key, ``window_key_range`` /
  ``window_query_range`` are the two walks, ``window_visible`` the element mask;
* split-KV decode (``split_program``, ``split_key_range``, ``split_window_range``): equal shares
  of a sequence's key blocks per split; the Triton and Gluon decode kernels both call them;
* packed sequences (``sequence_bounds``): a sequence's rows from the cu_seqlens offsets.

Each walk returns ranges in three kinds: blocks no row sees (never loaded), blocks every row sees
in full (no mask), and blocks on an edge (element mask). tests/test_block_ranges.py checks every
range against a brute-force mask over small shapes. The Gluon (Hopper) kernels call the same
functions: ``sm90_common.tile_coords`` / ``row_limits``, ``forward_hopper._blocks_seen`` and
``backward_hopper._bwd_coords`` wrap them for their persistent tile walks.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sequence_bounds(CU_Q, CU_K, off_b):
    """Packed sequences (VARLEN kernels): sequence off_b's first query row and first key row (int64),
    and its own query and key counts, from the [B + 1] offsets."""
    q_start = tl.load(CU_Q + off_b).to(tl.int64)
    k_start = tl.load(CU_K + off_b).to(tl.int64)
    seqlen_q = (tl.load(CU_Q + off_b + 1) - q_start).to(tl.int32)
    seqlen_k = (tl.load(CU_K + off_b + 1) - k_start).to(tl.int32)
    return q_start, k_start, seqlen_q, seqlen_k

@triton.jit
def causal_mask(rows, cols, off):
    """The causal element mask: row i sees key j when j <= i + off (off = seqlen_k - seqlen_q,
    bottom-right aligned), for rows and cols already broadcast to the tile's orientation ([BM, 1]
    and [1, BN], or transposed), as ``window_visible``."""
    return cols <= rows + off

@triton.jit
def causal_col_limit(rows, off):
    """The same rule as a per-row bound (the Gluon kernels' form): row i sees the keys below
    i + off + 1 (to be clipped to the sequence's end by the caller)."""
    return rows + off + 1

@triton.jit
def causal_key_end(start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr):
    """One past the last key the last row of the query block [start_m, start_m + BLOCK_M) sees under
    causal masking (its diagonal + 1; not clipped: at most 0, or past the keys, when the block sees
    none or all of them). ``causal_key_range``'s hi before clipping."""
    return start_m + BLOCK_M + (seqlen_k - seqlen_q)

@triton.jit
def first_full_query_block(start_n, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first BLOCK_M query block all of whose rows see every key of the key block [start_n,
    start_n + BLOCK_N) under causal masking: the block holding its last key's diagonal row, rounded
    up. ``causal_query_range``'s full_from in blocks (the Gluon dK/dV kernel counts in blocks)."""
    return tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - (seqlen_k - seqlen_q), 0), BLOCK_M)

@triton.jit
def full_key_blocks(start_m, seqlen_q, seqlen_k, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """How many whole BLOCK_N key blocks from key 0 on every query row from start_m on sees: the
    blocks the first row's causal diagonal already passes (bottom-right aligned), or all whole
    blocks without causal masking. ``causal_key_range``'s off_band_end in blocks; the Gluon kernels'
    ``sm90_common.row_limits`` counts in blocks."""
    if IS_CAUSAL:
        # Off-band: keys the first row of the block already sees, so every row sees them.
        first_row_end = tl.maximum(start_m + (seqlen_k - seqlen_q) + 1, 0)
        return tl.minimum(first_row_end // BLOCK_N, seqlen_k // BLOCK_N)
    else:
        return seqlen_k // BLOCK_N

@triton.jit
def causal_key_range(start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     IS_CAUSAL: tl.constexpr):
    """Key ranges of the query block [start_m, start_m + BLOCK_M): (off_band_end, hi).

    Keys [0, off_band_end) come in whole BLOCK_N blocks that every row of the block sees: no mask
    (``full_key_blocks``). Keys [off_band_end, hi) need the element mask (the causal diagonal, the
    ragged end of the keys). No key from hi on is visible to any row, so those blocks are never
    visited. Causal masking is bottom-right aligned: row i sees key j when j <= i + (seqlen_k -
    seqlen_q). The Gluon kernels take hi for a tile (``sm90_common.tile_coords``) and for one
    warpgroup's rows (``forward_hopper._blocks_seen``)."""
    off_band_end = full_key_blocks(start_m, seqlen_q, seqlen_k, BLOCK_N, IS_CAUSAL) * BLOCK_N
    if IS_CAUSAL:
        # Nothing past the last row's diagonal.
        hi = tl.minimum(tl.maximum(causal_key_end(start_m, seqlen_q, seqlen_k, BLOCK_M), 0), seqlen_k)
    else:
        hi = seqlen_k
    return off_band_end, hi

@triton.jit
def causal_query_range(start_n, seqlen_q, seqlen_k, q_blocks_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       IS_CAUSAL: tl.constexpr):
    """The key block [start_n, start_n + BLOCK_N)'s query rows (the transpose of ``causal_key_range``):
    (lo, full_from). Rows [lo, full_from) need the causal mask, rows [full_from, q_blocks_end) see
    every key of the block; rows before lo see none of it. q_blocks_end is seqlen_q rounded up to
    BLOCK_M (the caller's, so that its loop bound and this range are one value); all are multiples
    of BLOCK_M. Without causal, every row sees every key: (0, 0)."""
    if IS_CAUSAL:
        causal_offset = seqlen_k - seqlen_q
        # The block's first key is seen from row start_n - causal_offset on; rows from
        # start_n + BLOCK_N - 1 - causal_offset on see every key of the block (no mask needed).
        lo = (tl.maximum(start_n - causal_offset, 0) // BLOCK_M) * BLOCK_M
        full_from = first_full_query_block(start_n, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N) * BLOCK_M
        full_from = tl.minimum(tl.maximum(full_from, lo), q_blocks_end)
    else:
        lo = 0
        full_from = 0
    return lo, full_from

def window_bounds(window, causal: bool, max_q: int, max_k: int) -> tuple[bool, tuple[int, int] | None]:
    """(causal, window) as the kernels take a validated window_size (left, right) (-1: no bound on
    that side), for at most ``max_q`` queries and ``max_k`` keys per sequence.

    A bound that already reaches every key is no bound: left >= max_k (row i's left edge,
    i + Sk - Sq - left, is then below key 0) and right >= max_q - 1 (row 0's right edge is then past
    the last key) become -1, so huge bounds never reach the kernels' sums. Causal is folded in (its
    right bound is 0), and a right bound of 0 with no left one is causal attention. The window is
    None where the plain causal / non-causal kernels compute it, which are the fastest."""
    left, right = window if window is not None else (-1, -1)
    if left >= max_k:
        left = -1
    if right >= max(max_q - 1, 0):
        right = -1
    if causal or (left < 0 and right == 0):
        causal, right = True, 0
    if left < 0 and (right < 0 or causal):
        return causal, None
    return causal, (left, right)

def window_kernel_args(window: tuple[int, int] | None) -> dict:
    """The keyword arguments a kernel launch (Triton or Gluon) takes for ``window_bounds``' window:
    window_left, window_right (None for an unbounded side, so a launch without a window passes no
    runtime argument for it) and the HAS_LEFT / HAS_RIGHT flags."""
    left, right = window if window is not None else (-1, -1)
    return dict(window_left=left if left >= 0 else None, window_right=right if right >= 0 else None,
                HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0)

@triton.jit
def window_key_range(start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key ranges of the query block [start_m, start_m + BLOCK_M) under a local (sliding) window:
    row i sees key j when i + off - window_left <= j (HAS_LEFT) and j <= i + off + window_right
    (HAS_RIGHT), off = seqlen_k - seqlen_q (bottom-right aligned; causal is window_right = 0).

    Returns (lo, mid_lo, mid_hi, hi): keys [lo, mid_lo) and [mid_hi, hi) need the element mask, and
    [mid_lo, mid_hi) are whole BLOCK_N blocks every row of the block sees. Nothing outside [lo, hi)
    is visible to any row. lo, mid_lo and mid_hi are multiples of BLOCK_N."""
    off = seqlen_k - seqlen_q
    first = start_m + off                                   # the first row's diagonal key
    last = start_m + BLOCK_M - 1 + off                      # the last row's
    full_end = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(last + window_right + 1, 0), seqlen_k)
        mid_hi = tl.minimum(tl.maximum(first + window_right + 1, 0) // BLOCK_N * BLOCK_N, full_end)
    else:
        hi = seqlen_k
        mid_hi = full_end
    if HAS_LEFT:
        lo = tl.minimum(tl.maximum(first - window_left, 0), seqlen_k) // BLOCK_N * BLOCK_N
        mid_lo = tl.cdiv(tl.minimum(tl.maximum(last - window_left, 0), seqlen_k), BLOCK_N) * BLOCK_N
    else:
        lo = 0
        mid_lo = 0
    mid_lo = tl.maximum(mid_lo, lo)
    mid_hi = tl.maximum(mid_hi, mid_lo)                     # no whole block seen by every row
    return lo, mid_lo, mid_hi, hi

@triton.jit
def window_query_range(start_n, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """The key block [start_n, start_n + BLOCK_N)'s query rows under a local window (the transpose of
    ``window_key_range``; row i sees key j when i + off - left <= j <= i + off + right).
    Returns (lo, mid_lo, mid_hi, hi): rows [lo, mid_lo) and [mid_hi, hi) need the mask, the whole
    BLOCK_M blocks [mid_lo, mid_hi) see every key of the block."""
    off = seqlen_k - seqlen_q
    q_end = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    last_key = start_n + BLOCK_N - 1
    if HAS_RIGHT:                   # row i sees key j from i >= j - off - right on
        lo = tl.minimum(tl.maximum(start_n - off - window_right, 0), q_end) // BLOCK_M * BLOCK_M
        mid_lo = tl.cdiv(tl.minimum(tl.maximum(last_key - off - window_right, 0), q_end), BLOCK_M) * BLOCK_M
    else:
        lo = 0
        mid_lo = 0
    if HAS_LEFT:                    # ... up to i <= j - off + left
        hi = tl.minimum(tl.maximum(last_key - off + window_left + 1, 0), q_end)
        mid_hi = tl.minimum(tl.maximum(start_n - off + window_left + 1, 0), q_end) // BLOCK_M * BLOCK_M
    else:
        hi = q_end
        mid_hi = q_end
    mid_lo = tl.maximum(mid_lo, lo)
    mid_hi = tl.maximum(mid_hi, mid_lo)
    return lo, mid_lo, mid_hi, hi

@triton.jit
def window_visible(rows, cols, off, window_left, window_right, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr):
    """The mask of a local window (``window_key_range``'s rule) for query rows against key cols,
    given already broadcast to the tile's orientation ([BM, 1] and [1, BN], or transposed)."""
    visible = None
    if HAS_RIGHT:
        visible = cols <= rows + (off + tl.cast(window_right, tl.int64))
    if HAS_LEFT:
        left_ok = cols >= rows + (off - tl.cast(window_left, tl.int64))
        if HAS_RIGHT:
            visible = visible & left_ok
        else:
            visible = left_ok
    return visible

@triton.jit
def split_program(SEQLENS, stride_sl, heads_kv, seqlen_k, seqlen_new, num_m_blocks, num_splits,
                    HAS_SEQLENS: tl.constexpr):
    """Which (M block, split, KV head, batch) this program owns, and its sequence's length (keys
    attended). Returns (pid_m, split, off_hk, off_b, seqlen). The Gluon decode kernel
    (decode_hopper.py) calls it and ``split_key_range`` too, so both kernels cut the work the same way."""
    # 1-D grid (no 65535 limit); the M blocks of one split are neighbours: they read the same K/V.
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    rest = pid // num_m_blocks
    split = rest % num_splits
    rest = rest // num_splits
    off_hk = rest % heads_kv
    off_b = rest // heads_kv
    if HAS_SEQLENS:
        seqlen = tl.load(SEQLENS + off_b * stride_sl) + seqlen_new
    else:
        seqlen = seqlen_k
    return pid_m, split, off_hk, off_b, seqlen

@triton.jit
def split_key_range(seqlen, split, num_splits, seqlen_q, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """This split's keys: (lo, mid, hi, causal_offset). [lo, mid) are whole blocks every row sees in
    full (unmasked); [mid, hi) the rest (masked). causal_offset = seqlen - seqlen_q."""
    # Equal shares of the sequence's key blocks, in int64: with the lengths check off a sequence may
    # hold nearly 2^31 keys, where the rounded-up shares (and the block count) pass int32. An empty
    # split (a share past the end) gets lo = hi = seqlen, and both loops run zero times.
    n_blocks = tl.cdiv(tl.cast(seqlen, tl.int64), BLOCK_N)
    blocks_per_split = tl.cdiv(n_blocks, num_splits)
    first = split * blocks_per_split * BLOCK_N
    hi = tl.minimum(first + blocks_per_split * BLOCK_N, seqlen).to(tl.int32)
    lo = tl.minimum(first, seqlen).to(tl.int32)
    # Keys every row sees: all of them, or with causal masking those up to the first row's diagonal.
    causal_offset = seqlen - seqlen_q
    if IS_CAUSAL:
        seen_by_all = tl.maximum(causal_offset + 1, 0)
    else:
        seen_by_all = seqlen
    # mid is a multiple of BLOCK_N: hi is one too unless hi = seqlen, and seen_by_all <= seqlen.
    mid = tl.minimum(tl.maximum((seen_by_all // BLOCK_N) * BLOCK_N, lo), hi)
    return lo, mid, hi, causal_offset


@triton.jit
def split_window_range(seqlen, split, num_splits, seqlen_q, window_left, window_right, BLOCK_N: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """``split_key_range`` under a local window: the key blocks from the one holding the first row's left
    edge to the sequence's end (the last row's right edge, L - 1 + right, is never before it), cut
    into the splits' equal shares of whole blocks; all of it is walked masked (a decode step's rows
    are few). Returns (lo, hi, causal_offset)."""
    causal_offset = seqlen - seqlen_q
    if HAS_LEFT:
        # int64: with an unchecked capacity (CHECK_SEQLENS off) the bound may be near 2^31.
        start = tl.maximum(causal_offset - tl.cast(window_left, tl.int64), 0).to(tl.int32) // BLOCK_N * BLOCK_N
    else:
        start = 0
    end = seqlen              # the last row's right edge, L - 1 + right, never falls short of L - 1
    # int64 shares, as in split_key_range; an empty split gets lo = hi = end.
    blocks_per_split = tl.cdiv(tl.cdiv(tl.maximum(tl.cast(end, tl.int64) - start, 0), BLOCK_N), num_splits)
    first = start + split * blocks_per_split * BLOCK_N
    hi = tl.minimum(first + blocks_per_split * BLOCK_N, end).to(tl.int32)
    lo = tl.minimum(first, end).to(tl.int32)
    return lo, hi, causal_offset
