"""Tile, warp and stage choices for the kernels, in one place.

The launchers never hard-code a block size: they ask this module. There are three sources of a config:

* the interpreter (``TRITON_INTERPRET=1``): one small config, so the CPU test suite stays fast and still
  crosses block boundaries at the awkward sizes the tests use;
* a table measured on an H200 (``docs/performance.md`` has the runs that chose it), keyed on the head
  dimension, dtype, causal flag and how much parallel work the shape gives;
* an explicit ``FwdConfig`` passed by tests and by the tuning script, which overrides both.

Other GPUs start from the H200's choice and shrink it until it fits the device's shared memory per
block (``fit_forward`` and friends, read from ``torch.cuda.get_device_properties``: sm_86/89/120 allow
99 KB, sm_80 163 KB, sm_90/100 227 KB, AMD CDNA 64 KB); nothing measured went into those shrunken
choices, only the rule "fits and keeps as much of the H200's tile as possible". ``DeviceFacts`` is
what the choosers read; tests pass one instead of a device. scripts/compile_check.py compiles every
choice for sm_80, 86, 89, 90, 100, 120 and AMD gfx942 / gfx90a and checks the compiled kernels' shared
memory against these limits. On AMD (ROCm's torch reports capabilities such as 9.0 and 9.4) the
Gluon Hopper kernels and TMA descriptors are never chosen: the portable kernels run there.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

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
    if INTERPRET:
        return INTERPRETER_BWD
    facts = device_facts(device)
    block_d = head_dim_block(head_dim)
    return _backward_cached(block_d, dtype, facts)


@functools.lru_cache(maxsize=256)
def _backward_cached(block_d: int, dtype, facts: DeviceFacts) -> tuple[BwdConfig, BwdConfig]:
    dkdv, dq = _backward_preference(block_d, dtype, facts)
    return (fit_backward(dkdv, kept="block_n", block_d=block_d, elt=dtype.itemsize, facts=facts),
            fit_backward(dq, kept="block_m", block_d=block_d, elt=dtype.itemsize, facts=facts))


def _backward_preference(block_d, dtype, facts) -> tuple[BwdConfig, BwdConfig]:
    """The H200's choice (before fitting to the device's shared memory)."""
    import torch

    if dtype == torch.float32:
        # IEEE fp32 dots are unrolled FMA code: small tiles keep registers and compile times sane.
        if block_d <= 64:
            return BwdConfig(32, 32, 4, 1), BwdConfig(32, 32, 4, 1)
        return BwdConfig(16, 32, 4, 1), BwdConfig(32, 16, 4, 1)
    # Measured on the H200 (docs/performance-notes.md#backward), fp16 at B4 H16 S4096. TMA
    # descriptors help the dQ kernel's K/V stream by 2-4%; the dK/dV kernel's Q/dO stream is as fast
    # or faster with pointer loads.
    tma = facts.tma
    if block_d <= 64:
        return BwdConfig(32, 128, 4, 3), BwdConfig(64, 64, 4, 3, tma)
    if block_d <= 128:
        return BwdConfig(32, 64, 4, 3), BwdConfig(64, 64, 4, 2, tma)
    return BwdConfig(16, 64, 4, 1), BwdConfig(64, 16, 4, 1)


def backward_shared_bytes(cfg: BwdConfig, *, kept: str, block_d: int, elt: int, tcgen05: bool = False) -> int:
    """Estimated shared memory of one Triton backward kernel, in bytes. ``kept``: the block the program
    holds ("block_n": dK/dV keeps K and V and walks Q and dO; "block_m": dQ keeps Q and dO and walks
    K and V). The kept pair of tiles, num_stages pairs of walked tiles (at least one), one
    [block_m, block_n] staging tile (P or dS into a dot operand layout), for 16-bit inputs one more
    walked tile (a transposed copy for the second dot), on tcgen05 GPUs a second staging tile, and
    SHARED_RESERVE. At or above every kernel compiled for sm_80-120 (90112 B compiled for the D=256
    dK/dV kernel on sm_80 against 93184 estimated; 100352 against 101376 for fp32 D=256)."""
    kept_rows = cfg.block_n if kept == "block_n" else cfg.block_m
    walked_rows = cfg.block_m if kept == "block_n" else cfg.block_n
    tiles = 2 * kept_rows * block_d + 2 * max(1, cfg.num_stages) * walked_rows * block_d
    transposed = walked_rows * block_d if elt == 2 else 0
    staging = cfg.block_m * cfg.block_n * (2 if tcgen05 else 1)
    return elt * (tiles + staging + transposed) + SHARED_RESERVE


def fit_backward(cfg: BwdConfig, *, kept: str, block_d: int, elt: int, facts: DeviceFacts) -> BwdConfig:
    """``cfg`` shrunk until ``backward_shared_bytes`` fits ``facts.shared_per_block``: stages down to
    2, the walked block down to 32, one stage, the kept block down to 32, then both down to 16.
    Unchanged where it fits (H200, H100, B200). Raises ValueError when nothing fits."""
    walked = "block_m" if kept == "block_n" else "block_n"
    if cfg.tma and not facts.tma:
        cfg = replace(cfg, tma=False)
    while (backward_shared_bytes(cfg, kept=kept, block_d=block_d, elt=elt, tcgen05=facts.tcgen05)
           > facts.shared_per_block):
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif getattr(cfg, walked) > 32:
            cfg = replace(cfg, **{walked: getattr(cfg, walked) // 2})
        elif cfg.num_stages > 1:
            cfg = replace(cfg, num_stages=1)
        elif getattr(cfg, kept) > 32:
            cfg = replace(cfg, **{kept: getattr(cfg, kept) // 2})
        elif getattr(cfg, walked) > 16:
            cfg = replace(cfg, **{walked: getattr(cfg, walked) // 2})
        elif getattr(cfg, kept) > 16:
            cfg = replace(cfg, **{kept: getattr(cfg, kept) // 2})
        else:
            raise _does_not_fit("backward", block_d, elt, facts)
    return cfg


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


@dataclass(frozen=True)
class DeviceFacts:
    """What the config choosers read from a GPU (``device_facts``). Every chooser also takes one of
    these in place of a device (tests, scripts/compile_check.py).

    major / minor: compute capability as torch reports it (ROCm's torch reports AMD GPUs as 9.0
    (gfx90a), 9.4 (gfx942), 9.5 (gfx950): never read it without ``is_hip``). sm_count: multiprocessors
    (compute units on AMD). shared_per_block: bytes of shared memory (LDS) one program may use, the
    opt-in maximum; Triton raises OutOfResources at launch above it."""

    major: int
    minor: int
    sm_count: int
    shared_per_block: int
    is_hip: bool = False
    name: str = ""

    @property
    def tma(self) -> bool:
        """Host-built TMA descriptors (NVIDIA sm_90 and newer)."""
        return not self.is_hip and self.major >= 9

    @property
    def tcgen05(self) -> bool:
        """NVIDIA sm_100/103/110 (datacenter Blackwell): Triton's tcgen05 MMA stages one more
        output-sized tile in shared memory than Hopper's wgmma (scripts/compile_check.py: 230400 B
        for the D=128 forward tile that takes 196664 B on sm_90)."""
        return not self.is_hip and self.major in (10, 11)

    @property
    def hopper(self) -> bool:
        """An NVIDIA sm_90 GPU: what the Gluon kernels' wgmma and setmaxnreg need."""
        return not self.is_hip and self.major == 9


# The opt-in shared memory per block by capability, for a torch without
# ``shared_memory_per_block_optin`` (CUDA programming guide, "Technical specifications per compute
# capability"); the property itself is read where present.
SHARED_PER_BLOCK = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448,
                    (10, 0): 232448, (10, 3): 232448, (11, 0): 232448, (12, 0): 101376, (12, 1): 101376}
SHARED_PER_BLOCK_UNKNOWN = 101376      # an NVIDIA capability not in the table (sm_75 and older: 65536)
SHARED_PER_BLOCK_HIP = 65536           # AMD CDNA 1-3 LDS (gfx950 has 160 KB and reports it)
# The GPU the tables were measured on: the choices there are the measured ones, unshrunk.
H200 = DeviceFacts(major=9, minor=0, sm_count=132, shared_per_block=232448, name="NVIDIA H200")


def device_facts(device) -> DeviceFacts:
    """The ``DeviceFacts`` of a CUDA (or ROCm) device, asked once per device (the launchers run on
    every call, and at short sequences their host time is what gets measured); a ``DeviceFacts``
    is returned as it is."""
    if isinstance(device, DeviceFacts):
        return device
    return _device_facts(device)


@functools.cache
def _device_facts(device) -> DeviceFacts:
    import torch

    try:
        props = torch.cuda.get_device_properties(device)
    except Exception:
        # Tests that run the compiled-mode choosers on CPU tensors: answer as the GPU the tables
        # were measured on (as before the choosers read more than the SM count).
        if torch.device(device).type != "cuda":
            return H200
        raise
    is_hip = getattr(torch.version, "hip", None) is not None
    shared = getattr(props, "shared_memory_per_block_optin", 0)
    if not shared:
        if is_hip:
            shared = SHARED_PER_BLOCK_HIP
        else:
            shared = SHARED_PER_BLOCK.get((props.major, props.minor),
                                          SHARED_PER_BLOCK_UNKNOWN if props.major >= 8 else 65536)
    return DeviceFacts(major=props.major, minor=props.minor, sm_count=props.multi_processor_count,
                       shared_per_block=int(shared), is_hip=is_hip,
                       name=getattr(props, "gcnArchName", "") or getattr(props, "name", ""))


def clear_device_cache():
    """Forget the devices asked so far (scripts/compile_check.py changes the answers between targets)."""
    _device_facts.cache_clear()
    _fit_forward_cached.cache_clear()
    _backward_cached.cache_clear()


def gluon_hopper_applies(*, head_dim: int, dtype, device) -> bool:
    """Whether the Gluon Hopper kernels (forward_hopper.py, backward_hopper.py, decode_hopper.py) can
    run this head dim and dtype: NVIDIA sm_90 exactly (their wgmma and setmaxnreg are Hopper
    instructions; never AMD, whose torch may also report major 9), fp16 or bf16, head_dim 64 or
    128. Each launcher's ``supported`` checks the tensors."""
    import torch

    if INTERPRET or dtype not in (torch.float16, torch.bfloat16) or head_dim not in (64, 128):
        return False
    if not isinstance(device, DeviceFacts) and torch.device(device).type != "cuda":
        return False
    return device_facts(device).hopper and gluon_available()


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton has the Gluon API the Hopper kernels use (Triton 3.4's lacks warpgroup_mma,
    for one). Where it does not, every call takes the portable Triton kernels, with one warning."""
    try:   # the names the Hopper kernel modules import
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon.language._core import builtin  # noqa: F401
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


@functools.cache
def gluon_tma_reduce_available() -> bool:
    """Whether this Triton's Gluon binds the TMA reduce-add (``sm90_common.tma_reduce_add``)."""
    if not gluon_available():
        return False
    from triton._C.libtriton import gluon_ir

    return hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce")


def sm_count(device) -> int:
    return device_facts(device).sm_count


def forward_config(*, head_dim: int, dtype, causal: bool, batch_heads: int, seqlen_q: int,
                   device) -> FwdConfig:
    """Pick the forward kernel's launch parameters for one problem shape."""
    if INTERPRET:
        return INTERPRETER_FWD
    facts = device_facts(device)
    block_d = head_dim_block(head_dim)
    cfg = _forward_preference(block_d, dtype, causal, batch_heads, seqlen_q, facts)
    return _fit_forward_cached(cfg, block_d, dtype.itemsize, facts)


@functools.lru_cache(maxsize=4096)
def _fit_forward_cached(cfg: FwdConfig, block_d: int, elt: int, facts: DeviceFacts) -> FwdConfig:
    """``fit_forward`` once per (config, device): the chooser runs on every call (host time)."""
    return fit_forward(cfg, block_d=block_d, elt=elt, facts=facts)


def _forward_preference(block_d, dtype, causal, batch_heads, seqlen_q, facts) -> FwdConfig:
    """The H200's choice (before fitting to the device's shared memory)."""
    import torch

    # Host-built 4-D descriptors measured fastest on the H200
    # (docs/performance-notes.md#forward-portable-triton-kernel).
    tma = "host" if facts.tma else "none"
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
    if cfg.block_m > 64 and batch_heads * cdiv(seqlen_q, cfg.block_m) < facts.sm_count:
        cfg = FwdConfig(64, 64, 4, 3, cfg.tma)
    return cfg


# Shared memory a config may need beyond its tiles (mbarriers, reduction scratch), in bytes.
SHARED_RESERVE = 1024


def forward_shared_bytes(cfg: FwdConfig, *, block_d: int, elt: int, tcgen05: bool = False) -> int:
    """Estimated shared memory of the Triton forward kernel, in bytes: the Q tile; the K and V
    buffers of Triton's software pipeline (num_stages - 1 pairs; one tile at num_stages 1); with TMA
    an O tile for the store; at 4 warps or fewer a [block_m, block_n] staging tile (P into a dot
    operand layout); on tcgen05 GPUs (``DeviceFacts.tcgen05``) one more O tile; and SHARED_RESERVE.
    At or above every kernel scripts/compile_check.py compiled for sm_80-120 (tests/test_gpu_configs.py
    keeps the measured values): 163840 B compiled against 164864 estimated for 128x128 tiles at
    D=128 without TMA, 196664 against 197632 with it (sm_90), 230400 against 230400 on sm_100; up to
    25% above at D=64 (Triton reuses the Q buffer for O)."""
    kv_tiles = 2 * (cfg.num_stages - 1) if cfg.num_stages > 1 else 1
    o_tile = (cfg.block_m if cfg.tma != "none" else 0) + (cfg.block_m if tcgen05 else 0)
    staging = cfg.block_m * cfg.block_n if cfg.num_warps <= 4 else 0
    return elt * (block_d * (cfg.block_m + kv_tiles * cfg.block_n + o_tile) + staging) + SHARED_RESERVE


def fit_forward(cfg: FwdConfig, *, block_d: int, elt: int, facts: DeviceFacts) -> FwdConfig:
    """``cfg`` shrunk step by step until ``forward_shared_bytes`` fits ``facts.shared_per_block``:
    key blocks down to 64, TMA off (its O staging tile), pipeline stages down to 2, query blocks
    down to 64 (at most 4 warps), key blocks down to 16, query blocks down to 16, one stage. Each
    step gives up what the H200's measurements valued least. Unchanged where it fits (the H200,
    H100 and B200 keep the measured table). Raises ValueError when even the smallest tile does not
    fit."""
    if cfg.tma != "none" and not facts.tma:
        cfg = replace(cfg, tma="none")
    limit = facts.shared_per_block
    while forward_shared_bytes(cfg, block_d=block_d, elt=elt, tcgen05=facts.tcgen05) > limit:
        if cfg.block_n > 64:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        elif cfg.tma != "none":
            cfg = replace(cfg, tma="none")
        elif cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_m > 64:
            cfg = replace(cfg, block_m=cfg.block_m // 2, num_warps=min(cfg.num_warps, 4))
        elif cfg.block_n > 16:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        elif cfg.block_m > 16:
            cfg = replace(cfg, block_m=cfg.block_m // 2, num_warps=min(cfg.num_warps, max(1, cfg.block_m // 32)))
        elif cfg.num_stages > 1:
            cfg = replace(cfg, num_stages=1)
        else:
            raise _does_not_fit("forward", block_d, elt, facts)
    return cfg


def _does_not_fit(kernel: str, block_d: int, elt: int, facts: DeviceFacts) -> ValueError:
    return ValueError(f"triflash: no {kernel} tile at head dim {block_d} ({8 * elt}-bit elements) fits the "
                      f"{facts.shared_per_block} bytes of shared memory per block of this GPU "
                      f"({facts.name or f'capability {facts.major}.{facts.minor}'}); use a smaller head "
                      f"dim or PyTorch's scaled_dot_product_attention")


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

    facts = None if INTERPRET else device_facts(device)
    sms = INTERPRETER_SM_COUNT if INTERPRET else facts.sm_count
    if (gluon_suits is not None and not INTERPRET and head_dim == 128 and facts.hopper
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
    if not INTERPRET:
        tile = fit_decode(tile, block_m=block_m, paged=paged, block_d=head_dim_block(head_dim),
                          elt=dtype.itemsize, facts=facts)
    if num_splits == 0:
        num_splits = decode_num_splits(programs=batch * heads_kv * m_blocks, max_seqlen=max_seqlen,
                                       block_n=tile.block_n, per_sm=tile.per_sm, sms=sms)
    num_splits = effective_splits(num_splits, max_seqlen, tile.block_n)
    return DecodeConfig(block_m=block_m, block_n=tile.block_n, num_warps=tile.num_warps,
                        num_stages=tile.num_stages, num_splits=num_splits)


def decode_shared_bytes(tile: _DecodeTile, *, block_m: int, paged: bool, block_d: int, elt: int) -> int:
    """Estimated shared memory of the Triton decode kernel: two query-sized tiles (fp32 stages the
    query twice), the K/V buffers (the contiguous loop's num_stages - 1, the paged loop's
    num_stages - 3, at least one pair), one [block_m, block_n] staging tile for P, and
    SHARED_RESERVE. At or above every kernel compiled for sm_80-90 (139264 B compiled for block_n
    128, 3 stages, contiguous, fp16 D=128, against 144384 estimated; 49152 against 52224 for fp32)."""
    buffers = max(1, tile.num_stages - (3 if paged else 1))
    return (elt * (2 * block_m * block_d + 2 * buffers * tile.block_n * block_d + block_m * tile.block_n)
            + SHARED_RESERVE)


def fit_decode(tile: _DecodeTile, *, block_m: int, paged: bool, block_d: int, elt: int,
               facts: DeviceFacts) -> _DecodeTile:
    """``tile`` shrunk until ``decode_shared_bytes`` fits ``facts.shared_per_block`` (K/V buffers
    down to one pair, then key blocks down to 16), with its programs per multiprocessor (what the
    split count fills) scaled by the device's shared memory against the H200's, at least one:
    resident programs are bounded by shared memory (untuned beyond the H200). Unchanged on
    H200 / H100 / B200. Raises ValueError when nothing fits."""
    min_stages = 4 if paged else 2
    # AMD's pipeliner keeps more of the paged loop's stages in LDS (66048 B compiled for gfx942 where
    # the NVIDIA count gives 44032): count them as the contiguous loop's.
    counted_paged = paged and not facts.is_hip
    while (decode_shared_bytes(tile, block_m=block_m, paged=counted_paged, block_d=block_d, elt=elt)
           > facts.shared_per_block):
        if tile.num_stages > min_stages:
            tile = _DecodeTile(tile.block_n, tile.num_warps, tile.num_stages - 1, tile.per_sm)
        elif tile.block_n > 16:
            tile = _DecodeTile(tile.block_n // 2, tile.num_warps, tile.num_stages, tile.per_sm)
        else:
            raise _does_not_fit("decode", block_d, elt, facts)
    if facts.shared_per_block < H200.shared_per_block:
        per_sm = max(1, tile.per_sm * facts.shared_per_block // H200.shared_per_block)
        tile = _DecodeTile(tile.block_n, tile.num_warps, tile.num_stages, per_sm)
    return tile


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
