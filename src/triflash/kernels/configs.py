"""Tile, warp and stage choices for the kernels, in one place.

The launchers never hard-code a block size: they ask this module. There are three sources of a config:

* the interpreter (``TRITON_INTERPRET=1``): one small config, so the CPU test suite stays fast and still
  crosses block boundaries at the awkward sizes the tests use;
* a table measured on an H200 (``docs/performance.md`` has the runs that chose it), keyed on the head
  dimension, dtype, causal flag and how much parallel work the shape gives;
* an explicit ``FwdConfig`` passed by tests and by the tuning script, which overrides both.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

# Read once: Triton decides between compiling and interpreting when a kernel is decorated.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class FwdConfig:
    """Launch parameters of the forward kernel.

    block_m / block_n: query rows and key columns per tile. num_warps / num_stages: Triton's launch
    options (stages = depth of the K/V software pipeline). tma: how tiles move between memory and
    the multiprocessor: "none" (pointer loads, any GPU) or "host" (4-D [B, S, H, D] tensor
    descriptors built by the launcher, moved by Hopper's TMA engine). The launcher falls back to
    "none" where the GPU or the tensor strides do not allow descriptors.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: str = "none"

    def __post_init__(self):
        if self.tma not in TMA_MODES:
            raise ValueError(f"FwdConfig.tma must be one of {sorted(TMA_MODES)}, got {self.tma!r}")


# (Descriptors built inside the kernel were measured slower than both on the H200 and were dropped:
# docs/performance-notes.md#forward-portable-triton-kernel.)
TMA_MODES = ("none", "host")


# The interpreter runs every program in Python over numpy blocks: fewer, larger tiles are faster, but
# tiles smaller than the test sizes are needed so that tails, several off-band blocks and the causal
# diagonal all occur. BLOCK_M != BLOCK_N on purpose: it catches a causal bound taken from the wrong block.
INTERPRETER_FWD = FwdConfig(block_m=64, block_n=32, num_warps=1, num_stages=1, tma="none")


@dataclass(frozen=True)
class BwdConfig:
    """Launch parameters of one backward kernel (dK/dV or dQ): tile sizes, warps, pipeline stages,
    and tma: stream the walked tiles (Q and dO for dK/dV, K and V for dQ) through host-built TMA
    descriptors (Hopper) instead of pointer loads; the launcher falls back where strides forbid it."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False


# Rows per program of the backward's preprocess (delta = rowsum(dO * O)): a memory-bound pass.
BWD_PREPROCESS_BLOCK_M = 64

# dK/dV keeps BLOCK_N keys and walks query blocks; dQ keeps BLOCK_M queries and walks key blocks.
# Unequal tiles on purpose, as in the forward's interpreter config.
INTERPRETER_BWD = (BwdConfig(32, 64, 1, 1), BwdConfig(64, 32, 1, 1))


def backward_config(*, head_dim: int, dtype, device) -> tuple[BwdConfig, BwdConfig]:
    """Pick (dK/dV config, dQ config) for the backward kernels."""
    import torch

    if INTERPRET:
        return INTERPRETER_BWD
    block_d = head_dim_block(head_dim)
    if dtype == torch.float32:
        # IEEE fp32 dots are unrolled FMA code: small tiles keep registers and compile times sane.
        if block_d <= 64:
            return BwdConfig(32, 32, 4, 1), BwdConfig(32, 32, 4, 1)
        return BwdConfig(16, 32, 4, 1), BwdConfig(32, 16, 4, 1)
    # Measured on the H200 (docs/performance-notes.md#backward), fp16 at B4 H16 S4096. TMA
    # descriptors help the dQ kernel's K/V stream by 2-4%; the dK/dV kernel's Q/dO stream is as fast
    # or faster with pointer loads.
    tma = _is_hopper_or_newer(device)
    if block_d <= 64:
        return BwdConfig(32, 128, 4, 3), BwdConfig(64, 64, 4, 3, tma)
    if block_d <= 128:
        return BwdConfig(32, 64, 4, 3), BwdConfig(64, 64, 4, 2, tma)
    return BwdConfig(16, 64, 4, 1), BwdConfig(64, 16, 4, 1)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host integers. ``triton.cdiv`` gives the same, but in Triton 3.6 it is a
    constexpr_function, whose call from host code costs ~7 us (it unwraps its arguments as
    constexprs); the launchers run on every call (docs/performance-notes.md#host-cost-per-call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, and 1 for n <= 1 (host integers; see ``cdiv``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def head_dim_block(head_dim: int) -> int:
    """The power of two (at least 16, the smallest tensor-core K) that holds head_dim."""
    return max(16, next_power_of_2(head_dim))


@functools.cache
def _device_facts(device) -> tuple[int, int]:
    """(compute capability major, multiprocessor count) of a CUDA device, asked once per device:
    the launchers run on every call, and at short sequences their host time is what gets measured."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return props.major, props.multi_processor_count


def _is_hopper_or_newer(device) -> bool:
    return _device_facts(device)[0] >= 9


def gluon_hopper_applies(*, head_dim: int, dtype, device) -> bool:
    """Whether the Gluon Hopper kernels (forward_hopper.py, backward_hopper.py, decode_hopper.py) can
    run this head dim and dtype: sm_90 exactly (their wgmma and setmaxnreg are Hopper instructions),
    fp16 or bf16, head_dim 64 or 128. Each launcher's ``supported`` checks the tensors."""
    import torch

    if INTERPRET or dtype not in (torch.float16, torch.bfloat16) or head_dim not in (64, 128):
        return False
    return torch.device(device).type == "cuda" and _device_facts(device)[0] == 9 and gluon_available()


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton has the Gluon API the Hopper kernels use (Triton 3.4's lacks warpgroup_mma,
    for one). Where it does not, every call takes the portable Triton kernels, with one warning."""
    try:   # the names the Hopper kernel modules import
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
            fence_async_shared,
            mbarrier,
            tma,
            warpgroup_mma,
            warpgroup_mma_wait,
        )
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError as exc:
        import warnings

        import triton

        warnings.warn(f"triflash: Triton {triton.__version__} lacks the Gluon API of triflash's Hopper kernels "
                      f"({exc}); every call runs the portable Triton kernels, which are slower on H100/H200. "
                      f"Triton 3.5 or later has it.", RuntimeWarning, stacklevel=2)
        return False
    return True


def sm_count(device) -> int:
    return _device_facts(device)[1]


def forward_config(*, head_dim: int, dtype, causal: bool, batch_heads: int, seqlen_q: int,
                   device) -> FwdConfig:
    """Pick the forward kernel's launch parameters for one problem shape."""
    import torch

    if INTERPRET:
        return INTERPRETER_FWD
    block_d = head_dim_block(head_dim)
    # Host-built 4-D descriptors measured fastest on the H200 (docs/performance-notes.md#forward-portable-triton-kernel).
    tma = "host" if _is_hopper_or_newer(device) else "none"
    if dtype == torch.float32:
        # fp32 dots run in IEEE fp32 on the CUDA cores: small tiles keep the registers in check.
        if block_d <= 64:
            return FwdConfig(64, 32, 4, 2, tma=tma)
        return FwdConfig(32, 32, 4, 1, tma=tma)
    # Measured on the H200 (docs/performance-notes.md#forward-portable-triton-kernel): fp16 at B4 H16 S4096 and B16 H16
    # S1024. Causal favours 64-row query blocks (less work on the masked diagonal, more programs for
    # the short causal rows); D=128 non-causal favours 128x128 tiles with 8 warps.
    if block_d <= 64:
        cfg = FwdConfig(64, 64, 4, 3, tma=tma) if causal else FwdConfig(128, 64, 4, 3, tma=tma)
    elif block_d <= 128:
        if causal and seqlen_q <= 2048:
            cfg = FwdConfig(64, 64, 4, 3, tma=tma)
        else:
            cfg = FwdConfig(128, 128, 8, 3, tma=tma)
    else:
        cfg = FwdConfig(64, 64, 4, 2, tma=tma)
    # Short problems: 64-row query blocks when the grid would leave multiprocessors idle.
    if cfg.block_m > 64 and batch_heads * cdiv(seqlen_q, cfg.block_m) < sm_count(device):
        cfg = FwdConfig(64, 64, 4, 3, cfg.tma)
    return cfg


# --------------------------------------------------------------------------------------------------
# Decode (flash_attn_with_kvcache) and merge
# --------------------------------------------------------------------------------------------------

GLUON_DECODE_ROWS = 64          # the Gluon decode kernel's query rows per program (one wgmma M)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the split-KV decode kernel.

    block_m: rows of the packed query tile (query heads of one KV head x query positions), at least
    16 for tl.dot; a group with more rows takes several M blocks. block_n: keys per iteration.
    num_warps / num_stages: Triton's launch options (stages = depth of the K/V load pipeline, which
    is what keeps enough bytes in flight for a memory-bound kernel). num_splits: how many programs
    share one sequence's keys (1 = no merge pass). kernel: "triton" (decode.py) or "gluon" (the
    TMA-fed Hopper kernel of decode_hopper.py; there num_stages is the depth of its K/V ring, and
    block_m is 64 and num_warps 4, one wgmma warpgroup).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1
    kernel: str = "triton"

    def __post_init__(self):
        if self.num_splits < 1:
            raise ValueError(f"DecodeConfig.num_splits must be >= 1 (a count, not 'choose'), got "
                             f"{self.num_splits}")
        if self.kernel not in ("triton", "gluon"):
            raise ValueError(f"DecodeConfig.kernel must be 'triton' or 'gluon', got {self.kernel!r}")
        if self.kernel == "gluon" and (self.block_m, self.num_warps) != (GLUON_DECODE_ROWS, 4):
            raise ValueError(f"DecodeConfig with kernel='gluon' takes block_m={GLUON_DECODE_ROWS} and "
                             f"num_warps=4 (one wgmma warpgroup), got block_m={self.block_m}, "
                             f"num_warps={self.num_warps}")


# The interpreter has no multiprocessors: pretend to have a few, so auto-splitting happens in tests.
INTERPRETER_SM_COUNT = 4
# Never split so finely that a split gets fewer key blocks than this (the merge pass and the
# per-program prologue/epilogue would start to cost more than the keys).
DECODE_MIN_BLOCKS_PER_SPLIT = 2
DECODE_MAX_SPLITS = 256
# One small config for the interpreter: BLOCK_N = 32 holds two pages of size 16 (one block-table read
# per page), 32 of size 1, and parts of pages of size 5 (one read per key), and divides page size 256
# (one page per key block), so every page path runs;
# BLOCK_M <= 32 makes an 8:1 group with Sq = 4 exactly one tile and larger groups take several.
INTERPRETER_DECODE = DecodeConfig(block_m=32, block_n=32, num_warps=1, num_stages=1)


@dataclass(frozen=True)
class _DecodeTile:
    block_n: int
    num_warps: int
    num_stages: int
    per_sm: int          # programs of this tile resident per multiprocessor (H200, D=128, fp16)


# Measured on the H200 (docs/performance-notes.md#decode-split-kv-paged),
# D=128 fp16, Hq=32, Hkv=8. per_sm is read off the timings: a launch of per_sm x 132 programs runs in
# one wave, one a little larger pays for a second, mostly idle, wave (the odd/even split-count
# pattern). num_stages counts Triton's pipeline stages, not buffers: the contiguous loop gets
# num_stages - 1 K/V buffers, the paged loop num_stages - 3 (its block-table read takes stages too),
# so paged tiles need two more stages for the same buffering.
_DECODE_NARROW = _DecodeTile(64, 4, 2, per_sm=4)        # few programs: many splits of a narrow tile
_DECODE_WIDE = _DecodeTile(128, 4, 2, per_sm=2)         # contiguous caches, many programs
_DECODE_WIDE_ONE_WAVE = _DecodeTile(128, 4, 3, per_sm=1)  # two K/V buffers, one program per SM
_DECODE_NARROW_PAGED = _DecodeTile(64, 4, 3, per_sm=4)
_DECODE_PAGED_ONE_WAVE = _DecodeTile(128, 4, 5, per_sm=1)  # two K/V buffers, one program per SM
_DECODE_PAGED_MANY = _DecodeTile(128, 4, 4, per_sm=3)   # one buffer, three programs per SM
_DECODE_WIDE_PAGED = _DecodeTile(128, 4, 2, per_sm=3)   # page sizes read key by key (not a power of 2)


def _decode_tile(*, programs: int, paged: bool, sms: int, page_size: int | None = None) -> _DecodeTile:
    """programs: (batch, KV head, M block) programs before splitting. page_size: the paged cache's
    (None: unknown); a power of two is read one block-table entry per page, any other key by key."""
    if paged:
        if programs < sms // 4:
            return _DECODE_NARROW_PAGED
        if programs <= sms:
            return _DECODE_PAGED_ONE_WAVE
        if page_size is not None and page_size & (page_size - 1) == 0:
            return _DECODE_PAGED_MANY
        return _DECODE_NARROW if programs >= 2 * sms else _DECODE_WIDE_PAGED
    if programs < sms // 4:
        return _DECODE_NARROW
    if sms // 2 <= programs <= sms:
        return _DECODE_WIDE_ONE_WAVE          # one program per SM, one wave, no merge
    return _DECODE_WIDE


def decode_num_splits(*, programs: int, max_seqlen: int, block_n: int, per_sm: int, sms: int) -> int:
    """Split count for ``num_splits=0``: as many splits as fill one wave of resident programs
    (per_sm per multiprocessor) without starting a second one, but at least
    DECODE_MIN_BLOCKS_PER_SPLIT key blocks per split. ``programs`` is the count before splitting,
    ``max_seqlen`` the longest sequence (keys attended, after an append)."""
    want = max(1, (per_sm * sms) // max(1, programs))
    by_length = cdiv(max(1, max_seqlen), block_n) // DECODE_MIN_BLOCKS_PER_SPLIT
    return max(1, min(want, by_length, DECODE_MAX_SPLITS))


def effective_splits(num_splits: int, max_seqlen: int, block_n: int) -> int:
    """Splits get whole key blocks (ceil(blocks / splits) each), so asking for more splits than that
    share can fill leaves the last ones empty: 66 splits of 1024 blocks are 64 splits of 16 and two
    empty programs. Return the number that actually get keys of the longest sequence."""
    blocks = cdiv(max(1, max_seqlen), block_n)
    return cdiv(blocks, cdiv(blocks, max(1, num_splits)))


# The Gluon decode kernel is taken where it was measured faster than the Triton one (H200,
# D=128, Hq=32, Hkv=8): few programs (batch x KV heads x M blocks below a quarter of the SMs, where
# the sequence is cut into many splits) and at least this many keys. There, at batch 1, it took 2-8%
# less time than the Triton kernel (8k: 21.8 against 23.5 us); at batch 2-4 it was level (+-1%);
# from batch 16 (one program per SM, no splits) it was 0.5-2% slower, so the Triton kernel stays.
GLUON_DECODE_MIN_KEYS = 8192
_DECODE_GLUON = _DecodeTile(128, 4, 2, per_sm=1)   # two K/V ring slots of 64 KiB: one program per SM


def decode_config(*, head_dim: int, dtype, rows: int, batch: int, heads_kv: int, max_seqlen: int,
                  num_splits: int, paged: bool, device, page_size: int | None = None,
                  gluon_suits=None) -> DecodeConfig:
    """Pick the decode kernel's launch parameters.

    rows = (query heads per KV head) x (query positions per sequence): the M dimension of one tile.
    num_splits: the caller's request; 0 means choose (``decode_num_splits``). Either way the count
    is lowered where some splits would get no key of the longest sequence (``effective_splits``).
    page_size: a paged cache's page size (the tile depends on whether it is a power of two).
    gluon_suits: None, or a function of no arguments saying whether the inputs suit the Gluon
    kernel (``decode_hopper.supported``). It is called only where the shape would take that kernel
    (GLUON_DECODE_MIN_KEYS's comment), so other calls do not pay for the check.
    """
    import torch

    sms = INTERPRETER_SM_COUNT if INTERPRET else sm_count(device)
    if (gluon_suits is not None and not INTERPRET and head_dim == 128
            and max_seqlen >= GLUON_DECODE_MIN_KEYS):
        programs = batch * heads_kv * cdiv(max(1, rows), GLUON_DECODE_ROWS)
        if programs < sms // 4 and gluon_suits():
            tile = _DECODE_GLUON
            if num_splits == 0:
                num_splits = decode_num_splits(programs=programs, max_seqlen=max_seqlen,
                                               block_n=tile.block_n, per_sm=tile.per_sm, sms=sms)
            return DecodeConfig(block_m=GLUON_DECODE_ROWS, block_n=tile.block_n,
                                num_warps=tile.num_warps, num_stages=tile.num_stages,
                                num_splits=effective_splits(num_splits, max_seqlen, tile.block_n),
                                kernel="gluon")
    wide = dtype == torch.float32 or head_dim_block(head_dim) > 128
    if INTERPRET:
        block_m_cap = INTERPRETER_DECODE.block_m
    else:
        block_m_cap = 32 if wide else 64
    block_m = max(16, min(next_power_of_2(max(1, rows)), block_m_cap))
    m_blocks = cdiv(max(1, rows), block_m)
    if INTERPRET:
        tile = _DecodeTile(INTERPRETER_DECODE.block_n, INTERPRETER_DECODE.num_warps,
                           INTERPRETER_DECODE.num_stages, per_sm=4)
    elif wide:
        # Large K/V tiles: narrow key blocks, a 2-deep pipeline (untuned beyond D=128 fp16).
        tile = _DecodeTile(32, 4, 2, per_sm=2)
    else:
        tile = _decode_tile(programs=batch * heads_kv * m_blocks, paged=paged, sms=sms,
                            page_size=page_size)
        if head_dim_block(head_dim) <= 64:
            tile = _DecodeTile(2 * tile.block_n, tile.num_warps, tile.num_stages, tile.per_sm)
    if num_splits == 0:
        num_splits = decode_num_splits(programs=batch * heads_kv * m_blocks, max_seqlen=max_seqlen,
                                       block_n=tile.block_n, per_sm=tile.per_sm, sms=sms)
    num_splits = effective_splits(num_splits, max_seqlen, tile.block_n)
    return DecodeConfig(block_m=block_m, block_n=tile.block_n, num_warps=tile.num_warps,
                        num_stages=tile.num_stages, num_splits=num_splits)


def merge_config(*, block_d: int, num_parts: int, num_rows: int, device) -> tuple[int, int, int]:
    """(BLOCK_R rows, BLOCK_P parts, num_warps) per merge program.

    A tile [BLOCK_R, BLOCK_P, BLOCK_D] holds about MERGE_TILE elements: all parts at once when they
    fit, else as many as fit; then as many rows as fit, but never so many that fewer than ~2 programs
    per multiprocessor remain (few rows: one row per program, many parts per step)."""
    tile = MERGE_TILE_INTERPRETER if INTERPRET else MERGE_TILE
    block_p = min(next_power_of_2(max(1, num_parts)), max(1, tile // block_d), MERGE_MAX_PAIRS)
    block_r = max(1, min(tile // (block_p * block_d), MERGE_MAX_PAIRS // block_p))
    if INTERPRET:
        return block_r, block_p, 1
    rows_for_two_waves = max(1, num_rows // (2 * sm_count(device)))
    block_r = min(block_r, 1 << (rows_for_two_waves.bit_length() - 1))   # a power of two
    return block_r, block_p, 4


MERGE_TILE = 4096
MERGE_TILE_INTERPRETER = 8192
# Triton 3.6 fails to compile the merge's [BLOCK_R, BLOCK_P, BLOCK_D] reductions for sm_90 once
# BLOCK_R * BLOCK_P reaches 256 (TritonGPUOptimizeThreadLocality; found with
# scripts/compile_check.py, e.g. [1, 256, 16] and [2, 128, 32]); 128 compiles at every head dim.
MERGE_MAX_PAIRS = 128
