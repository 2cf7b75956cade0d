"""Correctness before timing: the inputs of a workload, its reference results, and the tolerance rule.

Every provider is run once on the workload's inputs and compared with a reference before it is timed;
one that fails is reported as "wrong" (with its error) and never timed.

The tolerance rule is FlashAttention's (tests/helpers.py uses it too). For each checked tensor
(the output, and dq / dk / dv in the modes with a backward):

    max |got - ref|  <=  2 * max |same_dtype - ref|  +  eps(dtype) * max |ref|

* ``ref``: ``triflash.reference.attention_ref`` in float32 on the GPU (float64 on the CPU);
* ``same_dtype``: PyTorch's own attention in the benchmark's dtype (matmuls in fp16/bf16, softmax in
  fp32: the seeds' naive recipe), i.e. how far plain PyTorch at that precision lands from ``ref``.
  A kernel may be twice as far from the truth as that;
* the floor, about one unit in the last place of the largest reference value (eps = 2^-10 for fp16,
  2^-7 for bf16; FlashAttention's tests add a similar rounding term), only matters where PyTorch
  happens to be exact.

Both references process query rows in chunks (and the decode reference one sequence at a time), so
they fit in memory at every size the benchmark runs, where a naive S x S attention may not.
Gradients come from autograd through the same chunked reference, with the fixed random ``dout``.

Packed sequences (``--varlen``) are checked one sequence at a time against the same references, and
the score variants (``--softcap``, ``--sinks``, ``--alibi``) are passed to them: the reference computes
what the providers are asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..reference import flash_attn_ref, kvcache_ref
from .workloads import PAGE_SIZE, Workload, alibi_slopes

SEED = 0
# Scores alive at once in the chunked autograd reference (each chunk keeps a few tensors this size).
GRAD_REF_MAX_SCORES = 2**26


def reference_dtype(device) -> torch.dtype:
    """float32 on the GPU (fast, and far more precise than fp16/bf16); float64 on the CPU."""
    return torch.float32 if torch.device(device).type == "cuda" else torch.float64


@dataclass
class Expected:
    """What one output tensor of a provider must match, in the canonical [B, S, H, D] layout."""

    name: str
    ref: torch.Tensor
    tol: float


@dataclass
class CheckResult:
    ok: bool
    max_err: float
    tol: float
    detail: str


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| computed in b's dtype; NaN if a has a NaN (so a NaN never passes a check)."""
    return (a.to(b.dtype) - b).abs().max().item()


def expected(name: str, ref: torch.Tensor, same_dtype: torch.Tensor, dtype: torch.dtype) -> Expected:
    """Apply the tolerance rule of this module's docstring to one tensor."""
    floor = torch.finfo(dtype).eps * ref.abs().max().item()
    return Expected(name, ref, 2 * max_abs_diff(same_dtype, ref) + floor)


def check(got, expectations: list[Expected]) -> CheckResult:
    """Compare a provider's tensors (same order as ``expectations``) with the references.

    Reports the tensor closest to (or furthest past) its tolerance.
    """
    worst = None
    for exp, tensor in zip(expectations, got, strict=True):
        if tuple(tensor.shape) != tuple(exp.ref.shape):
            return CheckResult(False, math.nan, exp.tol, f"{exp.name} has shape {tuple(tensor.shape)}, "
                                                         f"expected {tuple(exp.ref.shape)}")
        err = max_abs_diff(tensor, exp.ref)
        ratio = err / exp.tol if err <= exp.tol else math.inf    # NaN errors land here too
        if worst is None or ratio > worst[0]:
            worst = (ratio, exp.name, err, exp.tol)
    _, name, err, tol = worst
    if err <= tol:
        return CheckResult(True, err, tol, f"{name} max error {err:.2e} <= tolerance {tol:.2e}")
    return CheckResult(False, err, tol, f"{name} max error {err:.3g} > tolerance {tol:.3g}")


def _randn(shape, dtype, device, generator) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, device=device, generator=generator)


# --------------------------------------------------------------------------------------------------
# fwd / bwd / fwdbwd
# --------------------------------------------------------------------------------------------------

@dataclass
class ScoreVariants:
    """The score variants' tensors of a workload (``Workload.variants``), made once per case: every
    provider gets the same values. ``sinks``: float32 [Hq] drawn from a normal distribution with a
    fixed seed and rounded to bfloat16's precision (FlashAttention 4 takes its sinks in bfloat16: the
    values stay the same); ``alibi_slopes``: float32 [Hq], the standard slopes (``alibi_slopes``)."""

    softcap: float = 0.0
    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None

    def reference_kwargs(self) -> dict:
        return {"softcap": self.softcap, "sinks": self.sinks, "alibi_slopes": self.alibi_slopes}


def make_variants(wl: Workload, device) -> ScoreVariants:
    """The tensors ``wl``'s score variants need (none without variants)."""
    sinks = slopes = None
    if wl.sinks:
        gen = torch.Generator().manual_seed(SEED + 1)
        sinks = torch.randn(wl.heads, generator=gen).to(torch.bfloat16).float().to(device)
    if wl.alibi:
        slopes = torch.tensor(alibi_slopes(wl.heads), dtype=torch.float32, device=device)
    return ScoreVariants(wl.softcap, sinks, slopes)


@dataclass
class DenseCase:
    """Inputs of one fwd/bwd/fwdbwd workload in FlashAttention's layout [B, S, H, D] (packed
    sequences: [total, H, D], sequence b in rows cu_seqlens[b]..cu_seqlens[b + 1] - 1), plus what a
    correct provider returns: the output, and in the modes with a backward also dq, dk, dv for the
    fixed random ``dout``, in the same layout."""

    workload: Workload
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor | None
    expected: list[Expected]
    variants: ScoreVariants = field(default_factory=ScoreVariants)
    cu_seqlens: torch.Tensor | None = None      # packed sequences: int32 [batch + 1] on the device

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None


def cu_seqlens_of(lengths, device) -> torch.Tensor:
    """int32 [len + 1] offsets: 0, l0, l0 + l1, ..."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def make_dense_case(wl: Workload, device) -> DenseCase:
    """Random inputs (fixed seed) and their reference results."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    dtype = wl.torch_dtype
    lead = (wl.tokens,) if wl.seqlens is not None else (wl.batch, wl.seqlen_q)
    lead_k = (wl.tokens,) if wl.seqlens is not None else (wl.batch, wl.seqlen_k)
    q = _randn((*lead, wl.heads, wl.head_dim), dtype, device, gen)
    k = _randn((*lead_k, wl.heads_kv, wl.head_dim), dtype, device, gen)
    v = _randn((*lead_k, wl.heads_kv, wl.head_dim), dtype, device, gen)
    dout = _randn(q.shape, dtype, device, gen) if wl.mode != "fwd" else None
    variants = make_variants(wl, device)
    ref_dtype = reference_dtype(device)
    window = wl.window or (-1, -1)
    per_sequence = _packed_reference if wl.seqlens is not None else _dense_reference
    refs = per_sequence(wl, q, k, v, dout, ref_dtype, window, variants)
    sames = per_sequence(wl, q, k, v, dout, None, window, variants)
    names = ("out", "dq", "dk", "dv")
    exps = [expected(n, r, s, dtype) for n, r, s in zip(names, refs, sames)]
    cu = cu_seqlens_of(wl.seqlens, device) if wl.seqlens is not None else None
    return DenseCase(wl, q, k, v, dout, exps, variants, cu)


def _dense_reference(wl, q, k, v, dout, compute_dtype, window, variants):
    """(out,) or (out, dq, dk, dv) on [B, S, H, D] tensors."""
    if dout is None:
        return (flash_attn_ref(q, k, v, wl.causal, compute_dtype=compute_dtype, window_size=window,
                               **variants.reference_kwargs()),)
    return reference_forward_backward(q, k, v, dout, wl.causal, compute_dtype, window=window,
                                      **variants.reference_kwargs())


def _packed_reference(wl, q, k, v, dout, compute_dtype, window, variants):
    """``_dense_reference`` of each packed sequence alone ([1, S_b, H, D]), concatenated back into
    the packed [total, H, D] layout."""
    parts, start = [], 0
    for n in wl.seqlens:
        rows = slice(start, start + n)
        args = [t[rows][None] for t in (q, k, v)] + [dout[rows][None] if dout is not None else None]
        parts.append([t[0] for t in _dense_reference(wl, *args, compute_dtype, window, variants)])
        start += n
    return tuple(torch.cat(ts) for ts in zip(*parts))


def reference_forward_backward(q, k, v, dout, causal: bool, compute_dtype,
                               max_scores: int = GRAD_REF_MAX_SCORES, window=(-1, -1), softcap=0.0,
                               sinks=None, alibi_slopes=None):
    """(out, dq, dk, dv) of the reference attention on [B, S, H, D] tensors with Sq == Sk.

    Autograd runs on a chunk of query rows at a time, so only that chunk's graph exists at once. This
    is exact: each query row depends on K and V only, so dq rows come from their own chunk and dk, dv
    are sums over chunks. The reference takes the chunk as rows [r0, r1) of the whole problem
    (``row_span``), so masks, windows and ALiBi's distances are the whole problem's; a chunk whose
    rows see no key past r1 (causal, or a window with right = 0) reads keys [0, r1) only.
    compute_dtype=None gives PyTorch's same-dtype attention (grads in the input dtype). The score
    variants (``softcap``, ``sinks``: not differentiated, ``alibi_slopes``) are passed through.
    """
    leaf_dtype = compute_dtype or q.dtype
    qh, kh, vh, doh = (t.transpose(1, 2) for t in (q, k, v, dout))      # [B, H, S, D] views
    batch, heads, seqlen, _ = qh.shape
    out, dq = torch.empty_like(qh, dtype=leaf_dtype), torch.empty_like(qh, dtype=leaf_dtype)
    dk, dv = torch.zeros_like(kh, dtype=leaf_dtype), torch.zeros_like(vh, dtype=leaf_dtype)
    prefix = causal or window[1] == 0        # rows [r0, r1) see keys [0, r1) at most
    rows = max(1, max_scores // (batch * heads * seqlen))
    variants = {"softcap": softcap, "sinks": sinks, "alibi_slopes": alibi_slopes}
    for r0 in range(0, seqlen, rows):
        r1 = min(seqlen, r0 + rows)
        keys = r1 if prefix else seqlen
        qc, kc, vc = (t.to(leaf_dtype).detach().requires_grad_()
                      for t in (qh[:, :, r0:r1], kh[:, :, :keys], vh[:, :, :keys]))
        # (start, total rows): rows [r0, r1) of the prefix problem of r1 rows over keys [0, r1), whose
        # bottom-right alignment is the square's, or of the whole square.
        span = (r0, r1) if prefix else (r0, seqlen)
        oc = flash_attn_ref(qc.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), causal,
                            compute_dtype=compute_dtype, window_size=window, row_span=span,
                            **variants).transpose(1, 2)
        gq, gk, gv = torch.autograd.grad(oc, (qc, kc, vc), doh[:, :, r0:r1].to(oc.dtype))
        out[:, :, r0:r1] = oc.detach()
        dq[:, :, r0:r1] = gq
        dk[:, :, :keys] += gk
        dv[:, :, :keys] += gv
    return tuple(t.transpose(1, 2) for t in (out, dq, dk, dv))


# --------------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------------

@dataclass
class PagedCache:
    """K/V split in pages of ``PAGE_SIZE`` tokens, placed in a shuffled order.

    k_pages / v_pages: [num_pages, page_size, Hkv, D]; block_table: [B, pages_per_sequence] int32,
    block_table[b, i] is the page that holds tokens [i * page_size, (i + 1) * page_size) of sequence b.
    """

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    block_table: torch.Tensor


@dataclass
class DecodeCase:
    """One query token per sequence against a K/V cache, every sequence ``context`` tokens long.

    q: [B, 1, Hq, D]; k_cache / v_cache: [B, S_alloc, Hkv, D] with S_alloc = context rounded up to a
    whole page; cache_seqlens: [B] int32, all equal to the context length.
    """

    workload: Workload
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    expected: list[Expected]
    variants: ScoreVariants = field(default_factory=ScoreVariants)

    @property
    def context(self) -> int:
        return self.workload.seqlen_k

    def paged(self, page_size: int = PAGE_SIZE) -> PagedCache:
        """A paged copy of the cache with a random (shuffled, fixed seed) page table."""
        batch, s_alloc, heads_kv, head_dim = self.k_cache.shape
        pages = s_alloc // page_size
        order = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(SEED))
        block_table = order.to(device=self.k_cache.device, dtype=torch.int32).view(batch, pages)
        where = block_table.flatten().long()

        def scatter(cache):
            out = cache.new_empty((batch * pages, page_size, heads_kv, head_dim))
            out[where] = cache.view(batch * pages, page_size, heads_kv, head_dim)
            return out

        return PagedCache(scatter(self.k_cache), scatter(self.v_cache), block_table)

    def args(self, paged: bool) -> tuple:
        """(q, k_cache, v_cache, cache_seqlens, block_table or None): the contiguous cache, or a paged
        copy (``paged()``)."""
        if not paged:
            return (self.q, self.k_cache, self.v_cache, self.cache_seqlens, None)
        cache = self.paged()
        return (self.q, cache.k_pages, cache.v_pages, self.cache_seqlens, cache.block_table)


def make_decode_case(wl: Workload, device) -> DecodeCase:
    """Random query and cache (fixed seed) and the reference output."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    dtype = wl.torch_dtype
    s_alloc = -(-wl.seqlen_k // PAGE_SIZE) * PAGE_SIZE
    q = _randn((wl.batch, 1, wl.heads, wl.head_dim), dtype, device, gen)
    k = _randn((wl.batch, s_alloc, wl.heads_kv, wl.head_dim), dtype, device, gen)
    v = _randn((wl.batch, s_alloc, wl.heads_kv, wl.head_dim), dtype, device, gen)
    seqlens = torch.full((wl.batch,), wl.seqlen_k, dtype=torch.int32, device=device)
    variants = make_variants(wl, device)
    kwargs = variants.reference_kwargs() if variants is not None else {}
    if wl.window is not None:
        kwargs["window_size"] = wl.window
    ref = kvcache_ref(q, k, v, cache_seqlens=wl.seqlen_k, compute_dtype=reference_dtype(device), **kwargs)
    same = kvcache_ref(q, k, v, cache_seqlens=wl.seqlen_k, compute_dtype=None, **kwargs)
    return DecodeCase(wl, q, k, v, seqlens, [expected("out", ref, same, dtype)], variants)


