"""Merging partial attention states: the kernel and its launcher.

Attention over a key set that was cut into N disjoint parts can be put back together from the parts'
results alone. Part n gives, for every query row, a normalised output O_n and the natural-log
log-sum-exp LSE_n of its scaled scores. Then, with M = max_n LSE_n,

    w_n = exp(LSE_n - M)          LSE = M + ln(sum_n w_n)          O = sum_n w_n * O_n / sum_n w_n

A part that saw no key (LSE_n = -inf) has weight 0 and its O_n is never read into the sum (so even a
NaN there cannot leak); a row whose parts are all empty gets O = 0 and LSE = -inf.

One program merges BLOCK_R consecutive rows (b, s, h) (flattened, h fastest) over all N parts,
BLOCK_P parts at a time, in two passes: the row max of the N LSEs, then the weighted sum, so each
part's output is scaled once (no repeated rescaling as in an online merge). Weights are exp2((LSE_n
- M) * log2(e)), the difference taken in the LSEs' own dtype; sums are fp32. The launcher sizes the
tiles so that both a few rows with many parts (split-KV decode of one long sequence: 32 rows, ~60
splits) and many rows with two parts (merging two prefill results) spread over the whole GPU.

Layout (merge_attn_states' convention): O_parts [N, B, S, H, D] (FlashAttention's layout per part,
any float dtype, last stride 1), LSE_parts [N, B, H, S] float32 (what flash_attn_func(...,
return_lse=True) returns, stacked; the public op takes float32, split-KV decode of fp32 inputs hands
this kernel float64). Every tensor is read and written through its strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs, launch
from .common import LN2_K, LOG2E_K, div_rn, on_input_device


@triton.jit(do_not_specialize=["num_parts", "seqlen", "num_rows"])   # no recompile per shape
def _merge_kernel(
    O_PART, LSE_PART, O, LSE,
    stride_pn, stride_pb, stride_ps, stride_ph,      # O_PART [N, B, S, H, D]
    stride_qn, stride_qb, stride_qh, stride_qs,      # LSE_PART [N, B, H, S]
    stride_ob, stride_os, stride_oh,                 # O [B, S, H, D]
    stride_lb, stride_lh, stride_ls,                 # LSE [B, H, S]
    num_parts, seqlen, heads, num_rows,
    SINKS,                                           # HAS_SINKS: [H] float32 (else None)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):
    """One program: BLOCK_R rows, all N parts, BLOCK_P parts per step ([BR, BP, BD] tiles, so that
    even a handful of rows with many parts (split-KV decode at batch 1) keeps many loads in flight).
    HAS_SINKS (split-KV decode with attention sinks): each head's sink joins as one more part whose
    output is 0 (a logit in the denominator only), so it is counted exactly once."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)         # [BR] flattened (b, s, h)
    r_ok = rows < num_rows
    off_h = rows % heads
    off_s = (rows // heads) % seqlen
    off_b = rows // (heads * seqlen)
    offs_p = tl.arange(0, BLOCK_P)                                     # [BP]
    offs_d = tl.arange(0, BLOCK_D)                                     # [BD]
    d_ok = offs_d < HEAD_DIM
    lse_row = off_b * stride_qb + off_h * stride_qh + off_s * stride_qs          # [BR] int64
    out_row = off_b * stride_pb + off_s * stride_ps + off_h * stride_ph          # [BR] int64

    # -- pass 1: the row max of the parts' LSEs --
    # (In the partial LSEs' own dtype: float32, or float64 from fp32 split-KV decode, whose LSEs
    # then carry no rounding error of their size into the weights.)
    m = tl.full([BLOCK_R], float("-inf"), dtype=LSE_PART.dtype.element_ty)
    for p0 in range(0, num_parts, BLOCK_P):
        parts = p0 + offs_p                                            # [BP]
        lse_ptrs = LSE_PART + parts[None, :].to(tl.int64) * stride_qn + lse_row[:, None]
        lse_p = tl.load(lse_ptrs, mask=r_ok[:, None] & (parts[None, :] < num_parts),
                        other=float("-inf"))                           # [BR, BP]
        m = tl.maximum(m, tl.max(lse_p, 1))
    if HAS_SINKS:
        sink = tl.load(SINKS + off_h, mask=r_ok, other=float("-inf")).to(m.dtype)     # [BR]
        m = tl.maximum(m, sink)
    # Rows with every part empty keep m = -inf: subtract 0 so their weights are exp2(-inf) = 0.
    m_safe = tl.where(m == float("-inf"), 0.0, m)

    # -- pass 2: weighted sum of the parts' outputs --
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        parts = p0 + offs_p                                            # [BP]
        p_ok = r_ok[:, None] & (parts[None, :] < num_parts)            # [BR, BP]
        lse_ptrs = LSE_PART + parts[None, :].to(tl.int64) * stride_qn + lse_row[:, None]
        lse_p = tl.load(lse_ptrs, mask=p_ok, other=float("-inf"))                   # [BR, BP]
        # Subtract first (exact when the LSEs are close), then scale to base 2 for exp2.
        w = tl.math.exp2((lse_p - m_safe[:, None]).to(tl.float32) * LOG2E_K)        # [BR, BP]
        has = p_ok & (lse_p != float("-inf"))                          # empty parts are never read
        o_ptrs = (O_PART + (parts[None, :].to(tl.int64) * stride_pn + out_row[:, None])[:, :, None]
                  + offs_d[None, None, :])
        o_p = tl.load(o_ptrs, mask=has[:, :, None] & d_ok[None, None, :], other=0.0)  # [BR, BP, BD]
        acc += tl.sum(w[:, :, None] * o_p.to(tl.float32), 1)
        total += tl.sum(w, 1)

    if HAS_SINKS:
        total += tl.math.exp2((sink - m_safe).to(tl.float32) * LOG2E_K)

    # -- epilogue --
    empty = total == 0.0
    t_safe = tl.where(empty, 1.0, total)
    if O.dtype.element_ty == tl.float32:
        out = div_rn(acc, t_safe[:, None])                             # IEEE division (see div_rn)
    else:
        out = acc / t_safe[:, None]
    lse = tl.where(empty, float("-inf"),
                   (m_safe + tl.math.log2(t_safe) * LN2_K).to(tl.float32))
    o_ptrs = O + (off_b * stride_ob + off_s * stride_os + off_h * stride_oh)[:, None] + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    tl.store(LSE + off_b * stride_lb + off_h * stride_lh + off_s * stride_ls, lse, mask=r_ok)


@on_input_device
def merge(out_partials: torch.Tensor, lse_partials: torch.Tensor, out: torch.Tensor | None = None,
          lse: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
    """Launch the merge on validated tensors: out_partials [N, B, S, H, D] (last stride 1),
    lse_partials [N, B, H, S] float32 (or float64: split-KV decode in fp32 keeps its partial LSEs
    there). ``out`` [B, S, H, D] (last stride 1; default: new, in
    out_partials' dtype) and ``lse`` [B, H, S] float32 may be given to write into.
    ``sinks`` ([H] float32, contiguous): attention sinks added once to every row's sum (split-KV
    decode's partials carry none). Returns (out, lse)."""
    num_parts, batch, seqlen, heads, head_dim = out_partials.shape
    if out is None:
        out = torch.empty(out_partials.shape[1:], dtype=out_partials.dtype, device=out_partials.device)
    if lse is None:
        lse = torch.empty((batch, heads, seqlen), dtype=torch.float32, device=out_partials.device)
    num_rows = batch * seqlen * heads
    if num_rows == 0:
        return out, lse
    block_d = configs.head_dim_block(head_dim)
    block_r, block_p, num_warps = configs.merge_config(block_d=block_d, num_parts=num_parts,
                                                       num_rows=num_rows, device=out.device)
    grid = (configs.cdiv(num_rows, block_r),)
    launch.run(
        _merge_kernel, grid,
        O_PART=out_partials, LSE_PART=lse_partials, O=out, LSE=lse,
        stride_pn=out_partials.stride(0), stride_pb=out_partials.stride(1), stride_ps=out_partials.stride(2),
        stride_ph=out_partials.stride(3),
        stride_qn=lse_partials.stride(0), stride_qb=lse_partials.stride(1), stride_qh=lse_partials.stride(2),
        stride_qs=lse_partials.stride(3),
        stride_ob=out.stride(0), stride_os=out.stride(1), stride_oh=out.stride(2),
        stride_lb=lse.stride(0), stride_lh=lse.stride(1), stride_ls=lse.stride(2),
        num_parts=num_parts, seqlen=seqlen, heads=heads, num_rows=num_rows, SINKS=sinks,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_P=block_p, HAS_SINKS=sinks is not None,
        num_warps=num_warps,
    )
    return out, lse
