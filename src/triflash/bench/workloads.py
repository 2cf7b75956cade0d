"""What the benchmark runs: workload shapes, and the conventions that turn times into TFLOP/s and GB/s.

Three sets of shapes:

* the seeds' workload (the default): B=4, H=16, S=4096, D=64;
* the FlashAttention papers' sweep (``--sweep``): 16k tokens per batch (B = 16384 // S) and a hidden
  size of 2048 (H = 2048 // D), S from 512 to 16k, D in {64, 128};
* the decode grid (``--mode decode``): one query token against a K/V cache, batch {1, 16, 64} x
  context {1k, 8k, 32k, 128k}, Hq=32, Hkv=8, D=128.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("fwd", "bwd", "fwdbwd", "decode", "host")

SEED = {"batch": 4, "heads": 16, "seqlen": 4096, "head_dim": 64}
SWEEP_TOKENS = 16384
SWEEP_HIDDEN = 2048
SWEEP_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
SWEEP_HEAD_DIMS = (64, 128)
DECODE_BATCHES = (1, 16, 64)
DECODE_CONTEXTS = (1024, 8192, 32768, 131072)
DECODE_SHAPE = {"heads": 32, "heads_kv": 8, "head_dim": 128}
PAGE_SIZE = 16
# --mode host: short calls, where the host time of a call decides what users see (B, S, H, D).
HOST_SHAPES = ((1, 128, 8, 64), (2, 512, 16, 128), (8, 1024, 16, 128))

# Backward FLOPs as a multiple of the forward's (FlashAttention's convention): the backward does five
# matmuls of the forward's size where the forward does two, hence 2.5; forward + backward is 3.5.
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}

FLOP_CONVENTION = (
    "FLOPs = 4·B·H·Sq·Sk·D for one forward (H = query heads; two matmuls of 2·Sq·Sk·D each per "
    "head), "
    "halved when causal; backward = 2.5 x forward, forward+backward = 3.5 x forward. "
    "TFLOP/s = FLOPs / median time.")
BYTES_CONVENTION = (
    "Decode GB/s = K/V bytes read / median time = 2·B·context·Hkv·D·(bytes per element) / time "
    "(the query, output and page table are not counted). Every decode provider is timed twice: as "
    "CUDA-graph replays of one call (graph us, as a serving engine runs decode steps; GB/s is from "
    "these) and as eager calls (eager us, as a plain generate loop runs them, host time included).")


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool, mode: str = "fwd", window: tuple[int, int] | None = None) -> float:
    """Floating-point operations of one call, by the convention in ``FLOP_CONVENTION``. With a local
    window the visible score entries are counted exactly (4·D FLOPs each), causal or not."""
    if window is not None:
        return 4.0 * batch * heads * visible_entries(seqlen_q, seqlen_k, window, causal) * head_dim \
            * MODE_FLOP_FACTOR[mode]
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        flops /= 2
    return flops * MODE_FLOP_FACTOR[mode]


def visible_entries(seqlen_q: int, seqlen_k: int, window: tuple[int, int], causal: bool) -> int:
    """Score entries a local window leaves visible (bottom-right aligned, -1: no bound on a side;
    causal bounds the right side at 0)."""
    left, right = window
    if causal:
        right = 0                     # causal bounds the right side at the diagonal
    rows = torch.arange(seqlen_q, dtype=torch.int64) + (seqlen_k - seqlen_q)
    lo = (rows - left).clamp(min=0) if left >= 0 else torch.zeros_like(rows)
    hi = (rows + right).clamp(max=seqlen_k - 1) if right >= 0 else torch.full_like(rows, seqlen_k - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


@dataclass(frozen=True)
class Workload:
    """One problem: every provider is checked and timed on it, side by side.

    For ``mode == "decode"``, seqlen_q is 1 and seqlen_k is the cache's context length.
    """

    mode: str
    batch: int
    heads: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str
    causal: bool
    window: tuple[int, int] | None = None      # local window (left, right), -1: no bound on a side

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def flops(self) -> float | None:
        """FLOPs of one call (None for decode, which is measured in bytes)."""
        if self.mode == "decode":
            return None
        return attention_flops(self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim,
                               self.causal, self.mode, self.window)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V that one call must read."""
        element_bytes = torch.finfo(self.torch_dtype).bits // 8
        return 2 * self.batch * self.seqlen_k * self.heads_kv * self.head_dim * element_bytes

    def label(self) -> str:
        """Short description for the progress line, e.g. ``S=2048 D=64 causal``."""
        if self.mode == "decode":
            return f"B={self.batch} context={self.seqlen_k} D={self.head_dim}"
        window = f" window={self.window[0]},{self.window[1]}" if self.window is not None else ""
        return f"S={self.seqlen_q} D={self.head_dim} {'causal' if self.causal else 'non-causal'}{window}"


def dense_workloads(mode: str, dtype: str, causal_flags, *, sweep: bool = False, batch=None,
                    heads=None, heads_kv=None, seqlens=None, head_dims=None, window=None) -> list[Workload]:
    """Workloads for fwd / bwd / fwdbwd. Explicit values win over the seed workload or the sweep.

    With ``sweep``, batch = 16384 // S and heads = 2048 // D unless given.
    Raises ValueError when heads_kv does not divide heads.
    """
    if seqlens is None:
        seqlens = SWEEP_SEQLENS if sweep else (SEED["seqlen"],)
    if head_dims is None:
        head_dims = SWEEP_HEAD_DIMS if sweep else (SEED["head_dim"],)
    out = []
    for head_dim in head_dims:
        for causal in causal_flags:
            for seqlen in seqlens:
                b = batch or (max(1, SWEEP_TOKENS // seqlen) if sweep else SEED["batch"])
                h = heads or (max(1, SWEEP_HIDDEN // head_dim) if sweep else SEED["heads"])
                out.append(_workload(mode, b, h, heads_kv or h, seqlen, seqlen, head_dim, dtype, causal, window))
    return out


def host_workloads(dtype: str, causal_flags, *, batch=None, heads=None, heads_kv=None, seqlens=None,
                   head_dims=None) -> list[Workload]:
    """--mode host: HOST_SHAPES unless a shape is given (then as ``dense_workloads``), as fwdbwd
    workloads (every provider is checked forward and backward before its calls are timed)."""
    if any(x is not None for x in (batch, heads, heads_kv, seqlens, head_dims)):
        return dense_workloads("fwdbwd", dtype, causal_flags, batch=batch, heads=heads, heads_kv=heads_kv,
                               seqlens=seqlens, head_dims=head_dims)
    return [_workload("fwdbwd", b, h, h, s, s, d, dtype, causal)
            for b, s, h, d in HOST_SHAPES for causal in causal_flags]


def decode_workloads(dtype: str, *, batch=None, heads=None, heads_kv=None, contexts=None,
                     head_dims=None) -> list[Workload]:
    """The decode grid: every batch size x every context length (explicit values win)."""
    batches = (batch,) if batch else DECODE_BATCHES
    heads = heads or DECODE_SHAPE["heads"]
    heads_kv = heads_kv or DECODE_SHAPE["heads_kv"]
    return [_workload("decode", b, heads, heads_kv, 1, context, head_dim, dtype, False)
            for head_dim in (head_dims or (DECODE_SHAPE["head_dim"],))
            for b in batches
            for context in (contexts or DECODE_CONTEXTS)]


def _workload(mode, batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, causal, window=None) -> Workload:
    if heads % heads_kv:
        raise ValueError(f"--heads-kv must divide the number of query heads: got {heads_kv} K/V heads "
                         f"for {heads} query heads")
    if window is not None and causal and window[1] > 0:
        raise ValueError(f"--window {window[0]},{window[1]} with a causal workload: the right bound must be "
                         f"0 or -1 (causal sees no later key); use --causal no")
    return Workload(mode, batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, causal, window)
