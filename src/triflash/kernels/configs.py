"""Tile, warp and stage choices for the kernels, in one place.

The launchers never hard-code a block size: they ask this module. There are three sources of a config:

* the interpreter (``TRITON_INTERPRET=1``): one small config, so the CPU test suite stays fast and still
  crosses block boundaries at the awkward sizes the tests use;
* a table measured on an H200 (``docs/performance.md`` has the runs that chose it), keyed on the head
  dimension, dtype, causal flag and how much parallel work the shape gives;
* an explicit ``FwdConfig`` passed by tests and by the tuning script, which overrides both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton

# Read once: Triton decides between compiling and interpreting when a kernel is decorated.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class FwdConfig:
    """Launch parameters of the forward kernel.

    block_m / block_n: query rows and key columns per tile. num_warps / num_stages: Triton's launch
    options (stages = depth of the K/V software pipeline). tma: how tiles move between memory and
    the multiprocessor: "none" (pointer loads, any GPU), "device" (tensor descriptors built in the
    kernel, one 2-D view per head) or "host" (4-D descriptors built by the launcher); both descriptor
    modes use Hopper's TMA engine. The launcher falls back to "none" where the GPU or the tensor
    strides do not allow descriptors. warp_specialize: ask Triton to split the off-band loop into
    producer (loads) and consumer (math) warps.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: str = "none"
    warp_specialize: bool = False

    def __post_init__(self):
        if self.tma not in TMA_MODES:
            raise ValueError(f"FwdConfig.tma must be one of {sorted(TMA_MODES)}, got {self.tma!r}")


TMA_MODES = {"none": 0, "device": 1, "host": 2}


# The interpreter runs every program in Python over numpy blocks: fewer, larger tiles are faster, but
# tiles smaller than the test sizes are needed so that tails, several off-band blocks and the causal
# diagonal all occur. BLOCK_M != BLOCK_N on purpose: it catches a causal bound taken from the wrong block.
INTERPRETER_FWD = FwdConfig(block_m=64, block_n=32, num_warps=1, num_stages=1, tma="none")


@dataclass(frozen=True)
class BwdConfig:
    """Launch parameters of one backward kernel (dK/dV or dQ): tile sizes, warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# dK/dV keeps BLOCK_N keys and walks query blocks; dQ keeps BLOCK_M queries and walks key blocks.
# Unequal tiles on purpose, as in the forward's interpreter config.
INTERPRETER_BWD = (BwdConfig(32, 64, 1, 1), BwdConfig(64, 32, 1, 1))


def backward_config(*, head_dim: int, dtype, causal: bool, device) -> tuple[BwdConfig, BwdConfig]:
    """Pick (dK/dV config, dQ config) for the backward kernels."""
    import torch

    if INTERPRET:
        return INTERPRETER_BWD
    block_d = head_dim_block(head_dim)
    if dtype == torch.float32:
        return BwdConfig(32, 32, 4, 1), BwdConfig(32, 32, 4, 1)
    if block_d <= 64:
        return BwdConfig(32, 128, 4, 3), BwdConfig(128, 32, 4, 3)
    if block_d <= 128:
        return BwdConfig(32, 128, 8, 2), BwdConfig(128, 32, 8, 2)
    return BwdConfig(16, 64, 4, 1), BwdConfig(64, 16, 4, 1)


def head_dim_block(head_dim: int) -> int:
    """The power of two (at least 16, the smallest tensor-core K) that holds head_dim."""
    return max(16, triton.next_power_of_2(head_dim))


def _is_hopper_or_newer(device) -> bool:
    import torch

    return torch.cuda.get_device_capability(device)[0] >= 9


def forward_config(*, head_dim: int, dtype, causal: bool, batch_heads: int, seqlen_q: int,
                   seqlen_k: int, device) -> FwdConfig:
    """Pick the forward kernel's launch parameters for one problem shape."""
    import torch

    if INTERPRET:
        return INTERPRETER_FWD
    block_d = head_dim_block(head_dim)
    # Host-built 4-D descriptors measured fastest on the H200 (docs/performance-notes.md, run 1).
    tma = "host" if _is_hopper_or_newer(device) else "none"
    if dtype == torch.float32:
        # fp32 dots run in IEEE fp32 on the CUDA cores: small tiles keep the registers in check.
        if block_d <= 64:
            return FwdConfig(64, 32, 4, 2, tma=tma)
        return FwdConfig(32, 32, 4, 1, tma=tma)
    if block_d <= 64:
        cfg = FwdConfig(128, 64, 4, 3, tma=tma)
    elif block_d <= 128:
        cfg = FwdConfig(128, 64, 4, 2, tma=tma)
    else:
        cfg = FwdConfig(64, 64, 4, 2, tma=tma)
    # Short problems: halve BLOCK_M when the grid would leave most multiprocessors idle.
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    if cfg.block_m > 64 and batch_heads * triton.cdiv(seqlen_q, cfg.block_m) < sm_count:
        cfg = FwdConfig(64, cfg.block_n, 4, cfg.num_stages, cfg.tma)
    return cfg

