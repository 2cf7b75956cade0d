"""Block ranges (kernels/block_ranges.py) against brute force: every walk's ranges are checked, over
small shapes exhaustively, against the boolean visibility mask [seqlen_q, seqlen_k] built in torch.

The rule (row i of seqlen_q, key j of seqlen_k, off = seqlen_k - seqlen_q): causal, j <= i + off;
a window (left, right; -1 = no bound on that side), i + off - left <= j and j <= i + off + right;
always 0 <= j < seqlen_k. A walk is correct when (1) every key (row) some valid row (key) sees lies
in a walked range, (2) every pair in an unmasked range is visible (and in bounds: unmasked tiles are
loaded with no key mask), (3) the ranges are disjoint and start on block boundaries, so no block is
folded twice. Rows past seqlen_q in a tile don't count: the kernels mask them (and never store them).

Each @triton.jit function is called from a small test kernel. The interpreter costs ~ms per program,
so each program evaluates CHUNK cases at once: the functions are elementwise, and ``_launch`` checks
on a sample that one case per program (the kernels' scalar call) gives the same numbers.
"""

import functools
import pathlib
import re

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, ON_GPU

from triflash.kernels import block_ranges
from triflash.kernels.block_ranges import (
    causal_col_limit,
    causal_key_range,
    causal_mask,
    causal_query_range,
    sequence_bounds,
    split_key_range,
    split_program,
    split_window_range,
    window_bounds,
    window_kernel_args,
    window_key_range,
    window_query_range,
    window_visible,
)

SEQLENS = [0, 1, 2, 5, 10, 16, 17, 33, 47, 64]              # their differences cover every residue mod 32
BLOCKS = [(16, 16), (16, 32), (32, 16), (32, 32)]           # (BLOCK_M, BLOCK_N)
SIDES = [-1, 0, 1, 7, 40]                                   # a window's left / right bound
# The windows of each (HAS_LEFT, HAS_RIGHT) specialisation; (-1, -1) is no window.
WINDOW_FLAGS = {(True, True): [(left, right) for left in SIDES[1:] for right in SIDES[1:]],
                (True, False): [(left, -1) for left in SIDES[1:]],
                (False, True): [(-1, right) for right in SIDES[1:]]}
FLAG_ID = {(True, True): "left_right", (True, False): "left", (False, True): "right"}
HUGE = 2**31 - 2                                            # an unchecked cache capacity's bound
CHUNK = 512
UNWRITTEN = -(2**40)                                        # an output the kernel failed to store


def cdiv(a, b):
    return -(-a // b)


# --------------------------------------------------------------------------------------------------
# Brute force
# --------------------------------------------------------------------------------------------------

@functools.cache
def mask(seqlen_q, seqlen_k, causal=False, left=-1, right=-1, rows=None):
    """[rows, seqlen_k] bool: row i sees key j. rows defaults to seqlen_q; rows past seqlen_q (a tile's
    padding) follow the same rule."""
    i = torch.arange(seqlen_q if rows is None else rows)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    diag = i + (seqlen_k - seqlen_q)
    m = torch.ones(i.shape[0], seqlen_k, dtype=torch.bool)
    if causal:
        m &= j <= diag
    if left >= 0:
        m &= j >= diag - left
    if right >= 0:
        m &= j <= diag + right
    return m


def tile_keys(seqlen_q, seqlen_k, start_m, block_m, **rule):
    """The query tile [start_m, start_m + block_m): (keys some valid row sees, keys every valid row
    sees, keys some row of the tile sees counting the padding rows past seqlen_q), each [seqlen_k]."""
    m = mask(seqlen_q, seqlen_k, rows=max(seqlen_q, start_m + block_m), **rule)
    valid = m[start_m:min(start_m + block_m, seqlen_q)]
    return valid.any(0), valid.all(0), m[start_m:start_m + block_m].any(0)


def block_rows(seqlen_q, seqlen_k, start_n, block_n, **rule):
    """The key block [start_n, start_n + block_n) cut at seqlen_k: (valid rows that see some key of it,
    valid rows that see every key of it), each [seqlen_q]."""
    cols = mask(seqlen_q, seqlen_k, **rule)[:, start_n:min(start_n + block_n, seqlen_k)]
    return cols.any(1), cols.all(1)


def query_tiles(block_m):
    """(start_m, seqlen_q, seqlen_k) of every query tile a kernel launches (none past seqlen_q)."""
    return [(s, sq, sk) for sq in SEQLENS for sk in SEQLENS for s in range(0, sq, block_m)]


def key_blocks(block_n):
    """(start_n, seqlen_q, seqlen_k) of every key block the dK/dV kernel launches."""
    return [(s, sq, sk) for sq in SEQLENS for sk in SEQLENS for s in range(0, sk, block_n)]


def assert_all_hold(failures, what):
    assert not failures, f"{what}: {len(failures)} cases break the contract, e.g.\n  " + "\n  ".join(failures[:8])


# --------------------------------------------------------------------------------------------------
# Test kernels: each program reads CHUNK rows of an int32 case table (one row when CHUNK == 1), calls
# the function once on them and stores what it returns in an int64 table.
# --------------------------------------------------------------------------------------------------

@triton.jit
def _cases(n, CHUNK: tl.constexpr):
    if CHUNK == 1:
        c = tl.program_id(0)                                # one case: a scalar call, as in the kernels
    else:
        c = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    return c, c < n


@triton.jit
def _causal_key_range_kernel(C, OUT, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                             CHUNK: tl.constexpr):
    c, ok = _cases(n, CHUNK)
    start_m = tl.load(C + 3 * c, mask=ok, other=0)
    seqlen_q = tl.load(C + 3 * c + 1, mask=ok, other=0)
    seqlen_k = tl.load(C + 3 * c + 2, mask=ok, other=0)
    off_band_end, hi = causal_key_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    tl.store(OUT + 2 * c, off_band_end, mask=ok)
    tl.store(OUT + 2 * c + 1, hi, mask=ok)


@triton.jit
def _causal_query_range_kernel(C, OUT, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                               CHUNK: tl.constexpr):
    c, ok = _cases(n, CHUNK)
    start_n = tl.load(C + 3 * c, mask=ok, other=0)
    seqlen_q = tl.load(C + 3 * c + 1, mask=ok, other=0)
    seqlen_k = tl.load(C + 3 * c + 2, mask=ok, other=0)
    q_blocks_end = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M        # the caller's, as in the dK/dV kernel
    lo, full_from = causal_query_range(start_n, seqlen_q, seqlen_k, q_blocks_end, BLOCK_M, BLOCK_N, IS_CAUSAL)
    tl.store(OUT + 2 * c, lo, mask=ok)
    tl.store(OUT + 2 * c + 1, full_from, mask=ok)


@triton.jit
def _window_range_kernel(C, OUT, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
                         HAS_RIGHT: tl.constexpr, QUERY: tl.constexpr, CHUNK: tl.constexpr):
    """QUERY: window_query_range (the case's start is a key block's), else window_key_range."""
    c, ok = _cases(n, CHUNK)
    start = tl.load(C + 5 * c, mask=ok, other=0)
    seqlen_q = tl.load(C + 5 * c + 1, mask=ok, other=0)
    seqlen_k = tl.load(C + 5 * c + 2, mask=ok, other=0)
    left = tl.load(C + 5 * c + 3, mask=ok, other=0)
    right = tl.load(C + 5 * c + 4, mask=ok, other=0)
    if QUERY:
        lo, mid_lo, mid_hi, hi = window_query_range(start, seqlen_q, seqlen_k, left, right, BLOCK_M, BLOCK_N,
                                                    HAS_LEFT, HAS_RIGHT)
    else:
        lo, mid_lo, mid_hi, hi = window_key_range(start, seqlen_q, seqlen_k, left, right, BLOCK_M, BLOCK_N,
                                                  HAS_LEFT, HAS_RIGHT)
    tl.store(OUT + 4 * c, lo, mask=ok)
    tl.store(OUT + 4 * c + 1, mid_lo, mask=ok)
    tl.store(OUT + 4 * c + 2, mid_hi, mask=ok)
    tl.store(OUT + 4 * c + 3, hi, mask=ok)


@triton.jit
def _split_key_range_kernel(C, OUT, n, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, CHUNK: tl.constexpr):
    c, ok = _cases(n, CHUNK)
    seqlen = tl.load(C + 4 * c, mask=ok, other=0)
    split = tl.load(C + 4 * c + 1, mask=ok, other=0)
    num_splits = tl.load(C + 4 * c + 2, mask=ok, other=1)
    seqlen_q = tl.load(C + 4 * c + 3, mask=ok, other=0)
    lo, mid, hi, causal_offset = split_key_range(seqlen, split, num_splits, seqlen_q, BLOCK_N, IS_CAUSAL)
    tl.store(OUT + 4 * c, lo, mask=ok)
    tl.store(OUT + 4 * c + 1, mid, mask=ok)
    tl.store(OUT + 4 * c + 2, hi, mask=ok)
    tl.store(OUT + 4 * c + 3, causal_offset, mask=ok)


@triton.jit
def _split_window_range_kernel(C, OUT, n, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                               CHUNK: tl.constexpr):
    c, ok = _cases(n, CHUNK)
    seqlen = tl.load(C + 6 * c, mask=ok, other=0)
    split = tl.load(C + 6 * c + 1, mask=ok, other=0)
    num_splits = tl.load(C + 6 * c + 2, mask=ok, other=1)
    seqlen_q = tl.load(C + 6 * c + 3, mask=ok, other=0)
    left = tl.load(C + 6 * c + 4, mask=ok, other=0)
    right = tl.load(C + 6 * c + 5, mask=ok, other=0)
    lo, hi, causal_offset = split_window_range(seqlen, split, num_splits, seqlen_q, left, right, BLOCK_N,
                                               HAS_LEFT, HAS_RIGHT)
    tl.store(OUT + 3 * c, lo, mask=ok)
    tl.store(OUT + 3 * c + 1, hi, mask=ok)
    tl.store(OUT + 3 * c + 2, causal_offset, mask=ok)


_SCALAR_CHECKED = set()


def _launch(kernel, cases, n_out, **meta):
    """Run ``kernel`` over the case table; returns one tuple of ints per case. A sample of the cases
    runs again one per program (scalar arguments, the kernels' own calls) and must agree: on every
    launch in the interpreter, on the first of each kernel on a GPU (each variant is a compile)."""
    table = torch.tensor(cases, dtype=torch.int32, device=DEVICE)

    def run(rows, chunk):
        out = torch.full((rows.shape[0], n_out), UNWRITTEN, dtype=torch.int64, device=DEVICE)
        kernel[(triton.cdiv(rows.shape[0], chunk),)](rows, out, rows.shape[0], **meta, CHUNK=chunk)
        return out

    got = run(table, CHUNK)
    if not (ON_GPU and kernel in _SCALAR_CHECKED):
        _SCALAR_CHECKED.add(kernel)
        sample = torch.arange(0, len(cases), max(1, len(cases) // 6), device=DEVICE)
        scalar = run(table[sample].contiguous(), 1)
        assert torch.equal(scalar, got[sample]), f"one case per program disagrees with a vector of cases ({meta})"
    return [tuple(r) for r in got.tolist()]


# --------------------------------------------------------------------------------------------------
# Causal (and plain) walks
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_m,block_n", BLOCKS, ids=lambda b: str(b))
def test_causal_key_range(block_m, block_n, causal):
    """The forward / dQ walk (off_band_end, hi) of every query tile: keys [0, off_band_end) are whole
    blocks inside seqlen_k that every valid row sees (walked unmasked); no row sees a key from hi on;
    off_band_end <= hi <= seqlen_k. Tightness: key hi - 1 is seen by some row of the tile (the
    tile's padding rows count: they are computed, then dropped), and the block after off_band_end
    is not one every row sees in full (it would have been left to the mask)."""
    cases = query_tiles(block_m)
    got = _launch(_causal_key_range_kernel, cases, 2, BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=causal)
    bad = []
    for (start_m, sq, sk), (off_band_end, hi) in zip(cases, got):
        some, every, tile = tile_keys(sq, sk, start_m, block_m, causal=causal)
        why = []
        if off_band_end % block_n or not 0 <= off_band_end <= hi <= sk:
            why.append("order / block alignment")
        elif not every[:off_band_end].all():
            why.append("an unmasked key some row does not see")
        if some[max(hi, 0):].any():
            why.append(f"key {hi + int(some[max(hi, 0):].nonzero()[0])} >= hi is visible")
        if hi > 0 and not tile[hi - 1]:
            why.append("hi is not tight")
        if off_band_end + block_n <= sk and every[off_band_end:off_band_end + block_n].all():
            why.append("a block every row sees is left to the mask")
        if why:
            bad.append(f"start_m={start_m} seqlen_q={sq} seqlen_k={sk} -> ({off_band_end}, {hi}): {', '.join(why)}")
    assert_all_hold(bad, "causal_key_range")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_m,block_n", BLOCKS, ids=lambda b: str(b))
def test_causal_query_range(block_m, block_n, causal):
    """The dK/dV walk (lo, full_from) of every key block, up to q_blocks_end (seqlen_q rounded up to
    BLOCK_M, the caller's): no valid row before lo sees a key of the block; every valid row in
    [full_from, q_blocks_end) sees every valid key of it (walked unmasked); lo <= full_from <=
    q_blocks_end, multiples of BLOCK_M. Tightness: the first row block walked holds a row that sees
    the key block."""
    cases = key_blocks(block_n)
    got = _launch(_causal_query_range_kernel, cases, 2, BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=causal)
    bad = []
    for (start_n, sq, sk), (lo, full_from) in zip(cases, got):
        some, every = block_rows(sq, sk, start_n, block_n, causal=causal)
        q_end = cdiv(sq, block_m) * block_m
        why = []
        if lo % block_m or full_from % block_m or not 0 <= lo <= full_from <= q_end:
            why.append("order / block alignment")
        if some[:max(lo, 0)].any():
            why.append(f"row {int(some.nonzero()[0])} < lo sees the block")
        if not every[max(full_from, 0):].all():
            why.append("an unmasked row does not see every key")
        if some.any() and not some[lo:lo + block_m].any():
            why.append("lo is not tight")
        if why:
            bad.append(f"start_n={start_n} seqlen_q={sq} seqlen_k={sk} -> ({lo}, {full_from}): "
                       f"{', '.join(why)}")
    assert_all_hold(bad, "causal_query_range")


# --------------------------------------------------------------------------------------------------
# Window walks
# --------------------------------------------------------------------------------------------------

def _check_window_ranges(ranges, block, limit, unmasked_end, some, every, what):
    """Shared by both window walks (block: the walk's step): nothing some row (key) sees outside
    [lo, hi); [mid_lo, mid_hi) wholly seen, and (if not empty) ending by unmasked_end; lo <= mid_lo <=
    mid_hi, block-aligned; hi <= limit. Returns the broken properties."""
    lo, mid_lo, mid_hi, hi = ranges
    why = []
    if lo % block or mid_lo % block or mid_hi % block or not 0 <= lo <= mid_lo <= mid_hi or hi > limit:
        why.append("order / block alignment")
        return why
    if mid_hi > mid_lo and mid_hi > unmasked_end:
        why.append(f"unmasked range past {unmasked_end}")
    if not every[mid_lo:mid_hi].all():
        why.append(f"an unmasked {what} not seen in full")
    if some[:lo].any():
        why.append(f"{what} {int(some.nonzero()[0])} < lo is visible")
    if some[max(hi, 0):].any():
        why.append(f"{what} {hi + int(some[max(hi, 0):].nonzero()[0])} >= hi is visible")
    return why


@pytest.mark.parametrize("flags", list(WINDOW_FLAGS), ids=FLAG_ID.get)
@pytest.mark.parametrize("block_m,block_n", BLOCKS, ids=lambda b: str(b))
def test_window_key_range(block_m, block_n, flags):
    """The windowed forward / dQ walk (lo, mid_lo, mid_hi, hi) of every query tile, for every window
    of sides {0, 1, 7, 40} (or unbounded): nothing outside [lo, hi) is visible to a valid row; keys
    [mid_lo, mid_hi) are whole blocks inside seqlen_k every valid row sees; lo <= mid_lo <= mid_hi,
    multiples of BLOCK_N; hi <= seqlen_k and tight (key hi - 1 is seen by a row of the tile, padding
    rows included)."""
    windows = WINDOW_FLAGS[flags]
    cases = [(s, sq, sk, left, right) for s, sq, sk in query_tiles(block_m) for left, right in windows]
    got = _launch(_window_range_kernel, cases, 4, BLOCK_M=block_m, BLOCK_N=block_n, HAS_LEFT=flags[0],
                  HAS_RIGHT=flags[1], QUERY=False)
    bad = []
    for (start_m, sq, sk, left, right), ranges in zip(cases, got):
        some, every, tile = tile_keys(sq, sk, start_m, block_m, left=left, right=right)
        why = _check_window_ranges(ranges, block_n, sk, sk // block_n * block_n, some, every, "key")
        if not why and ranges[3] > 0 and not tile[ranges[3] - 1]:
            why.append("hi is not tight")
        if why:
            bad.append(f"start_m={start_m} seqlen_q={sq} seqlen_k={sk} window=({left}, {right}) -> {ranges}: "
                       f"{', '.join(why)}")
    assert_all_hold(bad, "window_key_range")


@pytest.mark.parametrize("flags", list(WINDOW_FLAGS), ids=FLAG_ID.get)
@pytest.mark.parametrize("block_m,block_n", BLOCKS, ids=lambda b: str(b))
def test_window_query_range(block_m, block_n, flags):
    """The windowed dK/dV walk (lo, mid_lo, mid_hi, hi) of every key block: no valid row outside
    [lo, hi) sees a key of the block; valid rows in [mid_lo, mid_hi) see every valid key of it
    (walked unmasked; rows past seqlen_q read lse = +inf there, so p = 0); lo <= mid_lo <= mid_hi,
    multiples of BLOCK_M; hi and mid_hi within seqlen_q rounded up to BLOCK_M."""
    windows = WINDOW_FLAGS[flags]
    cases = [(s, sq, sk, left, right) for s, sq, sk in key_blocks(block_n) for left, right in windows]
    got = _launch(_window_range_kernel, cases, 4, BLOCK_M=block_m, BLOCK_N=block_n, HAS_LEFT=flags[0],
                  HAS_RIGHT=flags[1], QUERY=True)
    bad = []
    for (start_n, sq, sk, left, right), ranges in zip(cases, got):
        some, every = block_rows(sq, sk, start_n, block_n, left=left, right=right)
        q_end = cdiv(sq, block_m) * block_m
        why = _check_window_ranges(ranges, block_m, q_end, q_end, some, every, "row")
        if why:
            bad.append(f"start_n={start_n} seqlen_q={sq} seqlen_k={sk} window=({left}, {right}) -> {ranges}: "
                       f"{', '.join(why)}")
    assert_all_hold(bad, "window_query_range")


@triton.jit
def _window_visible_kernel(C, OUT, OUT_T, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr):
    """One case per program: rows r0 + [0, BM) against cols c0 + [0, BN), in both orientations."""
    c = tl.program_id(0)
    r0 = tl.load(C + 5 * c)
    c0 = tl.load(C + 5 * c + 1)
    off = tl.load(C + 5 * c + 2)
    left = tl.load(C + 5 * c + 3)
    right = tl.load(C + 5 * c + 4)
    rows = r0 + tl.arange(0, BM)
    cols = c0 + tl.arange(0, BN)
    tile = c * BM * BN
    v = window_visible(rows[:, None], cols[None, :], off, left, right, HAS_LEFT, HAS_RIGHT)       # [BM, BN]
    tl.store(OUT + tile + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], v.to(tl.int8))
    v_t = window_visible(rows[None, :], cols[:, None], off, left, right, HAS_LEFT, HAS_RIGHT)     # [BN, BM]
    tl.store(OUT_T + tile + tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :], v_t.to(tl.int8))


@pytest.mark.parametrize("flags", list(WINDOW_FLAGS), ids=FLAG_ID.get)
def test_window_visible(flags):
    """The element mask equals the window rule j - (i + off) in [-left, right] for every element, in
    the forward's orientation (rows [BM, 1], cols [1, BN]) and the dK/dV kernel's (transposed),
    for offsets of both signs and bounds up to 2^31 - 2 (the sums are in int64: no wrap)."""
    sides = [0, 1, 7, 40, HUGE]
    lefts = sides if flags[0] else [-1]
    rights = sides if flags[1] else [-1]
    cases = [(r0, c0, off, left, right) for r0, c0 in [(0, 0), (32, 0), (0, 48), (2**30, 2**30 - 20)]
             for off in (-45, -17, -1, 0, 3, 33) for left in lefts for right in rights]
    bm, bn = 32, 16
    table = torch.tensor(cases, dtype=torch.int32, device=DEVICE)
    out = torch.full((len(cases), bm, bn), -1, dtype=torch.int8, device=DEVICE)
    out_t = torch.full((len(cases), bn, bm), -1, dtype=torch.int8, device=DEVICE)
    _window_visible_kernel[(len(cases),)](table, out, out_t, HAS_LEFT=flags[0], HAS_RIGHT=flags[1], BM=bm, BN=bn)
    t = table.cpu().long()
    i = t[:, 0, None, None] + torch.arange(bm)[None, :, None]
    j = t[:, 1, None, None] + torch.arange(bn)[None, None, :]
    d = j - (i + t[:, 2, None, None])                          # key minus the row's diagonal
    want = torch.ones_like(d, dtype=torch.bool)
    if flags[0]:
        want &= d >= -t[:, 3, None, None]
    if flags[1]:
        want &= d <= t[:, 4, None, None]
    for name, got in (("[BM, BN]", out.cpu()), ("transposed", out_t.cpu().transpose(1, 2))):
        wrong = (got != want.to(torch.int8)).flatten(1).any(1).nonzero().flatten().tolist()
        assert not wrong, f"window_visible {name} differs from the rule for (r0, c0, off, left, right) in " \
                          f"{[cases[w] for w in wrong[:8]]}"


@triton.jit
def _causal_mask_kernel(C, OUT, OUT_T, LIMIT, BM: tl.constexpr, BN: tl.constexpr):
    """One case per program: rows r0 + [0, BM) against cols c0 + [0, BN), in both orientations, and
    the rows' bounds (``causal_col_limit``)."""
    c = tl.program_id(0)
    r0 = tl.load(C + 3 * c)
    c0 = tl.load(C + 3 * c + 1)
    off = tl.load(C + 3 * c + 2)
    rows = r0 + tl.arange(0, BM)
    cols = c0 + tl.arange(0, BN)
    tile = c * BM * BN
    v = causal_mask(rows[:, None], cols[None, :], off)                                          # [BM, BN]
    tl.store(OUT + tile + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], v.to(tl.int8))
    v_t = causal_mask(rows[None, :], cols[:, None], off)                                        # [BN, BM]
    tl.store(OUT_T + tile + tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :], v_t.to(tl.int8))
    tl.store(LIMIT + c * BM + tl.arange(0, BM), causal_col_limit(rows, off))


def test_causal_mask():
    """The causal element mask equals the rule j <= i + off for every element, in the forward's
    orientation and the transposed one, and the per-row bound i + off + 1 is the first key the row
    does not see, for offsets of both signs."""
    cases = [(r0, c0, off) for r0, c0 in [(0, 0), (32, 0), (0, 48), (2**20, 2**20 - 20)]
             for off in (-45, -17, -1, 0, 3, 33)]
    bm, bn = 32, 16
    table = torch.tensor(cases, dtype=torch.int32, device=DEVICE)
    out = torch.full((len(cases), bm, bn), -1, dtype=torch.int8, device=DEVICE)
    out_t = torch.full((len(cases), bn, bm), -1, dtype=torch.int8, device=DEVICE)
    limit = torch.full((len(cases), bm), -1, dtype=torch.int32, device=DEVICE)
    _causal_mask_kernel[(len(cases),)](table, out, out_t, limit, BM=bm, BN=bn)
    t = table.cpu().long()
    i = t[:, 0, None, None] + torch.arange(bm)[None, :, None]
    j = t[:, 1, None, None] + torch.arange(bn)[None, None, :]
    want = j <= i + t[:, 2, None, None]
    for name, got in (("[BM, BN]", out.cpu()), ("transposed", out_t.cpu().transpose(1, 2))):
        wrong = (got != want.to(torch.int8)).flatten(1).any(1).nonzero().flatten().tolist()
        assert not wrong, f"causal_mask {name} differs from the rule for (r0, c0, off) in " \
                          f"{[cases[w] for w in wrong[:8]]}"
    # Row i sees every key below its bound and none from it on.
    assert torch.equal(want, j < limit.cpu().long()[:, :, None])


# --------------------------------------------------------------------------------------------------
# Split-KV decode
# --------------------------------------------------------------------------------------------------

SPLIT_SEQLENS = [0, 1, 5, 16, 17, 33, 64, 100]
SPLIT_QUERIES = [1, 2, 5, 17, 70]                           # 70: more queries than keys
NUM_SPLITS = [1, 2, 3, 5, 8]


def _check_splits(splits, seqlen, block_n, some, every=None):
    """One sequence's splits [(split, lo, mid, hi)] (mid None: all masked): each non-empty split is a
    run of whole blocks from a block boundary inside the sequence (the last one may end at seqlen),
    the shares are balanced, no key is in two splits and every key ``some`` row sees is in one;
    [lo, mid) is seen by every row (``every``); an empty split runs neither loop."""
    why = []
    count = torch.zeros(seqlen, dtype=torch.long)
    blocks = []
    for split, lo, mid, hi in splits:
        if hi <= lo:
            if mid is not None and not hi <= mid <= lo:
                why.append(f"split {split}: empty but a loop runs")
            continue
        if lo % block_n or lo < 0 or hi > seqlen or (hi % block_n and hi != seqlen):
            why.append(f"split {split}: [{lo}, {hi}) is not whole blocks inside the sequence")
            continue
        if mid is not None:
            if mid % block_n or not lo <= mid <= hi:
                why.append(f"split {split}: mid {mid} misplaced")
            elif not every[lo:mid].all():
                why.append(f"split {split}: an unmasked key [{lo}, {mid}) some row does not see")
        count[lo:hi] += 1
        blocks.append(cdiv(hi - lo, block_n))
    if (count > 1).any():
        why.append(f"key {int((count > 1).nonzero()[0])} in two splits")
    missed = some & (count == 0)
    if missed.any():
        why.append(f"visible key {int(missed.nonzero()[0])} in no split")
    if blocks and max(blocks) > cdiv(sum(blocks), len(splits)):
        why.append(f"unequal shares {blocks}")
    return why, count


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_n", [16, 32])
def test_split_key_range(block_n, causal):
    """Every sequence length, query count and split count: the splits' [lo, hi) cover exactly the keys
    some row sees (all of the sequence), once each; each is whole blocks but at seqlen; shares are
    equal; [lo, mid) is seen by every row (walked unmasked); causal_offset = seqlen - seqlen_q."""
    cases = [(sl, split, n, sq) for sl in SPLIT_SEQLENS for sq in SPLIT_QUERIES for n in NUM_SPLITS
             for split in range(n)]
    got = _launch(_split_key_range_kernel, cases, 4, BLOCK_N=block_n, IS_CAUSAL=causal)
    groups = {}
    for (sl, split, n, sq), (lo, mid, hi, off) in zip(cases, got):
        groups.setdefault((sl, n, sq), []).append((split, lo, mid, hi, off))
    bad = []
    for (sl, n, sq), splits in groups.items():
        m = mask(sq, sl, causal=causal)
        some, every = m.any(0), m.all(0)
        why, count = _check_splits([s[:4] for s in splits], sl, block_n, some, every)
        if (count != some.long()).any():
            why.append("a key no row sees is walked")
        if any(s[4] != sl - sq for s in splits):
            why.append("causal_offset")
        if why:
            bad.append(f"seqlen={sl} seqlen_q={sq} num_splits={n} -> {[s[1:] for s in splits]}: {', '.join(why)}")
    assert_all_hold(bad, "split_key_range")


@pytest.mark.parametrize("flags", list(WINDOW_FLAGS), ids=FLAG_ID.get)
@pytest.mark.parametrize("block_n", [16, 32])
def test_split_window_range(block_n, flags):
    """The windowed decode walk: the splits' [lo, hi) hold every key some row sees (at least; all of it
    is walked masked), inside the sequence, once each, in equal shares of whole blocks. Left bounds
    up to 2^31 - 2 (a cache capacity's, with the lengths check off) with more queries than keys:
    the window's start is formed in int64 and does not wrap."""
    lefts = [0, 1, 7, 40, HUGE] if flags[0] else [-1]
    rights = [0, 1, 7, 40] if flags[1] else [-1]
    cases = [(sl, split, n, sq, left, right) for sl in SPLIT_SEQLENS for sq in SPLIT_QUERIES
             for left in lefts for right in rights for n in NUM_SPLITS for split in range(n)]
    got = _launch(_split_window_range_kernel, cases, 3, BLOCK_N=block_n, HAS_LEFT=flags[0], HAS_RIGHT=flags[1])
    groups = {}
    for (sl, split, n, sq, left, right), (lo, hi, off) in zip(cases, got):
        groups.setdefault((sl, n, sq, left, right), []).append((split, lo, None, hi, off))
    bad = []
    for (sl, n, sq, left, right), splits in groups.items():
        why, _ = _check_splits([s[:4] for s in splits], sl, block_n, mask(sq, sl, left=left, right=right).any(0))
        if any(s[4] != sl - sq for s in splits):
            why.append("causal_offset")
        if why:
            bad.append(f"seqlen={sl} seqlen_q={sq} window=({left}, {right}) num_splits={n} -> "
                       f"{[s[1:] for s in splits]}: {', '.join(why)}")
    assert_all_hold(bad, "split_window_range")


@pytest.mark.parametrize("seqlen,num_splits", [
    (2**31 - 64, 1), (2**31 - 64, 2), (2**31 - 64, 3), (2**31 - 64, 4), (2**31 - 64, 8), (2**31 - 1, 1),
    (2**31 - 1, 5)])
def test_split_ranges_near_int32(seqlen, num_splits):
    """Sequences of almost 2^31 keys (a wide block table over reused pages holds them in little memory):
    the splits still tile [0, seqlen) (the window's walk: from the first row's left edge's block) in
    order, with no wrapped sum (the shares and the block count were int32 and wrapped: the last
    splits came out empty, or every split at 2^31 - 1). Checked with intervals, the lengths being too long for masks."""
    block_n, bad = 32, []
    for seqlen_q in (1, 4):
        for window in (None, (100, 0), (HUGE, 0), (5, -1)):
            if window is None:
                cases = [(seqlen, s, num_splits, seqlen_q) for s in range(num_splits)]
                got = _launch(_split_key_range_kernel, cases, 4, BLOCK_N=block_n, IS_CAUSAL=True)
                first = 0
            else:
                cases = [(seqlen, s, num_splits, seqlen_q, *window) for s in range(num_splits)]
                got = _launch(_split_window_range_kernel, cases, 3, BLOCK_N=block_n, HAS_LEFT=True,
                              HAS_RIGHT=window[1] >= 0)
                first = max(seqlen - seqlen_q - window[0], 0)           # the first row's left edge
            runs = [(r[0], r[-2]) for r in got if r[-2] > r[0]]        # non-empty [lo, hi)
            ok = (runs and runs[0][0] <= first and runs[-1][1] == seqlen
                  and all(lo % block_n == 0 for lo, _ in runs)
                  and all(a[1] == b[0] for a, b in zip(runs, runs[1:])))
            if not ok:
                bad.append(f"seqlen_q={seqlen_q} window={window} -> {got}")
    assert_all_hold(bad, f"splits of seqlen={seqlen} in {num_splits}")


@triton.jit
def _split_program_kernel(SEQLENS, OUT, stride_sl, heads_kv, seqlen_k, seqlen_new, num_m_blocks, num_splits,
                          HAS_SEQLENS: tl.constexpr):
    pid_m, split, off_hk, off_b, seqlen = split_program(SEQLENS, stride_sl, heads_kv, seqlen_k, seqlen_new,
                                                        num_m_blocks, num_splits, HAS_SEQLENS)
    base = OUT + 5 * tl.program_id(0)
    tl.store(base, pid_m)
    tl.store(base + 1, split)
    tl.store(base + 2, off_hk)
    tl.store(base + 3, off_b)
    tl.store(base + 4, seqlen)


@pytest.mark.parametrize("has_seqlens", [False, True], ids=["fixed", "cache_seqlens"])
def test_split_program(has_seqlens):
    """The decode grid's program -> (M block, split, KV head, batch) map is a bijection onto the
    product, with the M blocks of one split neighbours (they read the same K/V); the sequence length
    is cache_seqlens[b] (read through its stride) + seqlen_new, or seqlen_k without it."""
    batch, heads_kv, num_m_blocks, num_splits, seqlen_k, seqlen_new = 3, 2, 4, 3, 50, 2
    seqlens = torch.tensor([[7, -1], [0, -1], [33, -1]], dtype=torch.int32, device=DEVICE)   # stride 2
    grid = batch * heads_kv * num_splits * num_m_blocks
    out = torch.full((grid, 5), UNWRITTEN, dtype=torch.int64, device=DEVICE)
    _split_program_kernel[(grid,)](seqlens, out, seqlens.stride(0), heads_kv, seqlen_k, seqlen_new, num_m_blocks,
                                   num_splits, HAS_SEQLENS=has_seqlens)
    rows = [tuple(r) for r in out.tolist()]
    owned = sorted(r[:4] for r in rows)
    assert owned == sorted((m, s, h, b) for m in range(num_m_blocks) for s in range(num_splits)
                           for h in range(heads_kv) for b in range(batch)), "not a bijection onto the grid"
    for pid in range(0, grid, num_m_blocks):
        group = rows[pid:pid + num_m_blocks]
        assert [r[0] for r in group] == list(range(num_m_blocks)), "one split's M blocks are not neighbours"
        assert len({r[1:] for r in group}) == 1
    for *_, off_b, seqlen in rows:
        want = int(seqlens[off_b, 0]) + seqlen_new if has_seqlens else seqlen_k
        assert seqlen == want, f"batch {off_b}: seqlen {seqlen}, want {want}"


@triton.jit
def _sequence_bounds_kernel(CU_Q, CU_K, OUT):
    off_b = tl.program_id(0)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(CU_Q, CU_K, off_b)
    tl.store(OUT + 4 * off_b, q_start)
    tl.store(OUT + 4 * off_b + 1, k_start)
    tl.store(OUT + 4 * off_b + 2, seqlen_q)
    tl.store(OUT + 4 * off_b + 3, seqlen_k)


def test_sequence_bounds():
    """Packed sequences: sequence b's first query and key rows are cu_seqlens[b], its lengths
    cu_seqlens[b + 1] - cu_seqlens[b] (empty sequences included)."""
    lq, lk = [3, 0, 17, 1, 64], [5, 9, 0, 1, 40]
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(x).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
                  for x in (lq, lk))
    out = torch.full((len(lq), 4), UNWRITTEN, dtype=torch.int64, device=DEVICE)
    _sequence_bounds_kernel[(len(lq),)](cu_q, cu_k, out)
    want = [(int(cu_q[b]), int(cu_k[b]), lq[b], lk[b]) for b in range(len(lq))]
    assert [tuple(r) for r in out.tolist()] == want


# --------------------------------------------------------------------------------------------------
# Host: window_bounds / window_kernel_args
# --------------------------------------------------------------------------------------------------

def _all_masks(max_q, max_k, causal, window):
    """[max_q + 1, max_k + 1, max_q, max_k]: the mask of every shape seqlen_q <= max_q, seqlen_k <=
    max_k at once (entries past a shape's lengths False). numpy: small single-threaded array ops."""
    left, right = window if window is not None else (-1, -1)
    sq = np.arange(max_q + 1)[:, None, None, None]
    sk = np.arange(max_k + 1)[None, :, None, None]
    i = np.arange(max_q)[None, None, :, None]
    j = np.arange(max_k)[None, None, None, :]
    d = j - (i + sk - sq)                                   # key minus the row's diagonal
    m = (i < sq) & (j < sk)
    if causal:
        m = m & (d <= 0)
    if left >= 0:
        m = m & (d >= -left)
    if right >= 0:
        m = m & (d <= right)
    return m


@pytest.mark.parametrize("max_q,max_k", [(1, 1), (1, 17), (17, 1), (5, 17), (17, 5), (16, 16), (0, 5), (5, 0)])
def test_window_bounds_keeps_the_mask(max_q, max_k):
    """window_bounds' (causal, window), read as the kernels read it (window_kernel_args' flags; the
    plain causal / full kernels where it is None), masks exactly what the caller's (window, causal)
    does (causal being a right bound of 0 on top of the window) for every shape up to max_q x max_k;
    and the bounds that reach the kernels are small (left < max_k, right < max_q - 1 or causal's 0: a
    bound reaching every key is no bound), so the kernels' sums stay far from 2^31."""
    sides = sorted({-1, 0, 1, 4, 5, 6, 15, 16, 17, 40, 2**31 - 1, 10**12, max_q - 1, max_q, max_k - 1, max_k} - {-2})
    bad = []
    for causal in (False, True):
        for window in [None] + [(left, right) for left in sides for right in sides]:
            out_causal, out_window = window_bounds(window, causal, max_q, max_k)
            want = _all_masks(max_q, max_k, causal, window)
            flags = window_kernel_args(out_window)
            wl, wr = flags["window_left"], flags["window_right"]
            if out_window is not None:
                assert flags["HAS_LEFT"] or flags["HAS_RIGHT"], f"{window}: a window with no bound"
                assert (wl is not None, wr is not None) == (flags["HAS_LEFT"], flags["HAS_RIGHT"]), flags
                got = _all_masks(max_q, max_k, False, (wl if flags["HAS_LEFT"] else -1,
                                                       wr if flags["HAS_RIGHT"] else -1))
                if (wl is not None and wl >= max_k) or (wr is not None and wr >= max(max_q - 1, 1)):
                    # (causal's right bound 0 stays)
                    bad.append(f"window={window} causal={causal}: bound {out_window} reaches the kernels")
            else:
                got = _all_masks(max_q, max_k, out_causal, None)
            if not np.array_equal(got, want):
                bad.append(f"window={window} causal={causal} -> ({out_causal}, {out_window}): another mask")
    assert_all_hold(bad, f"window_bounds(max_q={max_q}, max_k={max_k})")


def test_window_bounds_named_cases():
    """The folds the docstring names: no window and unbounded windows are the plain kernels; (-1, 0)
    is causal attention with or without causal=True; bounds reaching every key are dropped; a kept
    window's kernel flags follow its signs."""
    assert window_bounds(None, False, 100, 100) == (False, None)
    assert window_bounds((-1, -1), False, 100, 100) == (False, None)
    assert window_bounds((-1, -1), True, 100, 100) == (True, None)
    assert window_bounds((-1, 0), False, 100, 100) == (True, None)
    assert window_bounds((-1, 0), True, 100, 100) == (True, None)
    assert window_bounds((10**12, 10**12), False, 100, 100) == (False, None)
    assert window_bounds((100, 99), False, 100, 100) == (False, None)
    assert window_bounds((99, 98), False, 100, 100) == (False, (99, 98))
    assert window_bounds((10**12, 0), False, 100, 100) == (True, None)
    assert window_bounds((5, -1), True, 100, 100) == (True, (5, 0))
    def args(left, right, has_left, has_right):
        return dict(window_left=left, window_right=right, HAS_LEFT=has_left, HAS_RIGHT=has_right)
    # An unbounded side passes None (no runtime argument), the plain kernels none at all.
    assert window_kernel_args(None) == args(None, None, False, False)
    assert window_kernel_args((5, 0)) == args(5, 0, True, True)
    assert window_kernel_args((-1, 3)) == args(None, 3, False, True)
    assert window_kernel_args((4, -1)) == args(4, None, True, False)


# --------------------------------------------------------------------------------------------------
# One place for the rules
# --------------------------------------------------------------------------------------------------

def test_rules_live_only_in_block_ranges():
    """No module but block_ranges defines a block-range function (a ``*_range`` / ``*_ranges``
    function, or one named like block_ranges' own), so a kernel cannot drift to a private copy of
    a visibility rule; and the kernels that walk tiles import theirs from block_ranges."""
    src = pathlib.Path(block_ranges.__file__).resolve().parents[1]
    definition = re.compile(r"^\s*def\s+(\w+)\s*\(", re.MULTILINE)
    own = set(definition.findall(pathlib.Path(block_ranges.__file__).read_text()))
    assert {"causal_key_range", "window_query_range", "split_window_range", "window_bounds"} <= own
    copies = []
    for path in sorted(src.rglob("*.py")):
        if path.name == "block_ranges.py":
            continue
        for name in definition.findall(path.read_text()):
            if re.search(r"_ranges?$|key_ranges|query_ranges", name) or name in own:
                copies.append(f"{path.relative_to(src)}: def {name}")
    assert not copies, f"block-range rules defined outside block_ranges.py: {copies}"
    for module in ("forward", "backward", "decode", "decode_hopper"):
        text = (src / "kernels" / f"{module}.py").read_text()
        assert "from .block_ranges import" in text, f"kernels/{module}.py does not take its ranges from block_ranges"
