"""What the benchmark runs: workload shapes, and the conventions that turn times into TFLOP/s and GB/s.

Three sets of shapes:

* the seeds' workload (the default): B=4, H=16, S=4096, D=64;
* the FlashAttention papers' sweep (``--sweep``): 16k tokens per batch (B = 16384 // S) and a hidden
  size of 2048 (H = 2048 // D), S from 512 to 16k, D in {64, 128};
* the decode grid (``--mode decode``): one query token against a K/V cache, batch {1, 16, 64} x
  context {1k, 8k, 32k, 128k}, Hq=32, Hkv=8, D=128.

And two options on top of them: packed sequences of different lengths (``--varlen``, ``varlen_lengths``)
and the score variants (``--softcap``, ``--sinks``, ``--alibi``), carried by every ``Workload``.
"""

from __future__ import annotations

import random
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
    "With a window or packed sequences (varlen): 4·H·D per visible score entry, summed over the "
    "sequences. TFLOP/s = FLOPs / median time.")
BYTES_CONVENTION = (
    "Decode GB/s = K/V bytes read / median time = 2·B·context·Hkv·D·(bytes per element) / time "
    "(the query, output and page table are not counted; with a window, the keys it holds: "
    "min(context, left + 1) in place of context). Every decode provider is timed twice: as "
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


def varlen_flops(seqlens, heads: int, head_dim: int, causal: bool, mode: str = "fwd",
                 window: tuple[int, int] | None = None) -> float:
    """FLOPs of one call over packed sequences (each sequence its own Sq = Sk = its length): 4·H·D
    per visible score entry (``visible_entries``: S·(S+1)/2 causal, S² full, or the window's),
    summed over the sequences, times the mode's factor."""
    window = window or (-1, -1)
    entries = sum(visible_entries(s, s, window, causal) for s in seqlens)
    return 4.0 * heads * entries * head_dim * MODE_FLOP_FACTOR[mode]


def varlen_lengths(total: int, low: int, high: int, seed: int = 0) -> tuple[int, ...]:
    """``--varlen TOTAL:LOW-HIGH[:SEED]``: lengths drawn uniformly from LOW..HIGH (both included) by
    ``random.Random(seed)`` until they reach TOTAL tokens, the last one trimmed so that they sum to
    TOTAL exactly (it may then be shorter than LOW). The same arguments give the same lengths."""
    if not 1 <= low <= high or total < 1:
        raise ValueError(f"need TOTAL >= 1 and 1 <= MIN <= MAX, got {total}:{low}-{high}")
    rng, lengths, left = random.Random(seed), [], total
    while left > 0:
        lengths.append(min(rng.randint(low, high), left))
        left -= lengths[-1]
    return tuple(lengths)


VARIANT_NAMES = {"softcap": "soft-capping (softcap)", "sinks": "attention sinks", "alibi": "ALiBi slopes"}


def alibi_slopes(heads: int) -> list[float]:
    """The standard ALiBi slopes (Press et al.; BLOOM's and FlashAttention's tests' recipe): for a
    power of two n, 2^(-8·(h+1)/n); otherwise those of the nearest lower power of two m, then every
    other slope of 2m heads."""
    def power_of_two(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    m = 1 << (heads.bit_length() - 1)
    return power_of_two(m) + power_of_two(2 * m)[0::2][:heads - m]


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
    # Packed sequences of different lengths (--varlen): each one's length (Sq = Sk); batch is their
    # number and seqlen_q = seqlen_k the longest. None: a dense [B, S, H, D] batch.
    seqlens: tuple[int, ...] | None = None
    softcap: float = 0.0                       # score variants: logit soft-capping (0: none),
    sinks: bool = False                        # random float32 sinks per query head (seeded),
    alibi: bool = False                        # standard ALiBi slopes per query head

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def variants(self) -> tuple[str, ...]:
        """The score variants this workload uses, among "softcap", "sinks", "alibi"."""
        return tuple(name for name, on in (("softcap", self.softcap > 0), ("sinks", self.sinks),
                                           ("alibi", self.alibi)) if on)

    @property
    def tokens(self) -> int:
        """Query tokens of one call (B·Sq, or the packed sequences' total)."""
        return sum(self.seqlens) if self.seqlens is not None else self.batch * self.seqlen_q

    @property
    def flops(self) -> float | None:
        """FLOPs of one call (None for decode, which is measured in bytes)."""
        if self.mode == "decode":
            return None
        if self.seqlens is not None:
            return varlen_flops(self.seqlens, self.heads, self.head_dim, self.causal, self.mode, self.window)
        return attention_flops(self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim,
                               self.causal, self.mode, self.window)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V that one call must read (decode: with a window, the keys it holds)."""
        element_bytes = torch.finfo(self.torch_dtype).bits // 8
        keys = self.seqlen_k
        if self.window is not None and self.window[0] >= 0:
            keys = min(keys, self.window[0] + self.seqlen_q)
        return 2 * self.batch * keys * self.heads_kv * self.head_dim * element_bytes

    def varlen_label(self) -> str:
        """``varlen 14 seqs 512-4096, 32768 tokens`` ("" for a dense batch)."""
        if self.seqlens is None:
            return ""
        return (f"varlen {len(self.seqlens)} seqs {min(self.seqlens)}-{max(self.seqlens)}, "
                f"{self.tokens} tokens")

    def variants_label(self) -> str:
        """``softcap=30 sinks alibi`` ("" without score variants)."""
        return " ".join(f"softcap={self.softcap:g}" if v == "softcap" else v for v in self.variants)

    def label(self) -> str:
        """Short description for the progress line, e.g. ``S=2048 D=64 causal``."""
        variants = f" {self.variants_label()}" if self.variants else ""
        window = f" window={self.window[0]},{self.window[1]}" if self.window is not None else ""
        if self.mode == "decode":
            return f"B={self.batch} context={self.seqlen_k} D={self.head_dim}{window}{variants}"
        shape = self.varlen_label() if self.seqlens is not None else f"S={self.seqlen_q}"
        return f"{shape} D={self.head_dim} {'causal' if self.causal else 'non-causal'}{window}{variants}"


def dense_workloads(mode: str, dtype: str, causal_flags, *, sweep: bool = False, batch=None,
                    heads=None, heads_kv=None, seqlens=None, head_dims=None, window=None, varlen=None,
                    variants=None) -> list[Workload]:
    """Workloads for fwd / bwd / fwdbwd. Explicit values win over the seed workload or the sweep.

    With ``sweep``, batch = 16384 // S and heads = 2048 // D unless given. ``varlen``: a list of
    length tuples, one packed workload each (instead of ``seqlens`` and ``batch``). ``variants``:
    ``{"softcap": float, "sinks": bool, "alibi": bool}`` for every workload.
    Raises ValueError when heads_kv does not divide heads.
    """
    variants = variants or {}
    if varlen:
        h_dims = head_dims or (SEED["head_dim"],)
        h = heads or SEED["heads"]
        return [_workload(mode, len(lengths), h, heads_kv or h, max(lengths), max(lengths), head_dim, dtype,
                          causal, window, seqlens=tuple(lengths), **variants)
                for head_dim in h_dims for causal in causal_flags for lengths in varlen]
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
                out.append(_workload(mode, b, h, heads_kv or h, seqlen, seqlen, head_dim, dtype, causal, window,
                                     **variants))
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
                     head_dims=None, window=None, variants=None) -> list[Workload]:
    """The decode grid: every batch size x every context length (explicit values win); ``window``:
    each query token sees its last left + 1 keys (the right bound has nothing to its right)."""
    batches = (batch,) if batch else DECODE_BATCHES
    heads = heads or DECODE_SHAPE["heads"]
    heads_kv = heads_kv or DECODE_SHAPE["heads_kv"]
    return [_workload("decode", b, heads, heads_kv, 1, context, head_dim, dtype, False, window, **(variants or {}))
            for head_dim in (head_dims or (DECODE_SHAPE["head_dim"],))
            for b in batches
            for context in (contexts or DECODE_CONTEXTS)]


def _workload(mode, batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, causal, window=None,
              **extra) -> Workload:
    if heads % heads_kv:
        raise ValueError(f"--heads-kv must divide the number of query heads: got {heads_kv} K/V heads "
                         f"for {heads} query heads")
    if window is not None and causal and window[1] > 0:
        raise ValueError(f"--window {window[0]},{window[1]} with a causal workload: the right bound must be "
                         f"0 or -1 (causal sees no later key); use --causal no")
    return Workload(mode, batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, causal, window, **extra)
