"""Plain PyTorch attention with triflash's semantics, for tests and benchmarks.

* ``naive_attention``: the seeds' naive version, verbatim in spirit: materialises the S x S scores and
  probabilities, softmax in fp32, matmuls in the input dtype. Square causal only (Sq == Sk), one K/V
  head per query head. This is the baseline the benchmark compares against.
* ``attention_ref``: the same semantics as ``triflash.attention`` ([B, H, S, D]): GQA/MQA,
  bottom-right causal for Sq != Sk, rows that see no key give out = 0 and lse = -inf. It computes in
  ``compute_dtype``: float64 for the "truth", or the input dtype to measure how far PyTorch's own
  same-precision attention lands from the truth (the tests' tolerance is relative to that).
* ``flash_attn_ref``: the same in FlashAttention's [B, S, H, D] layout.
"""

from __future__ import annotations

import math

import torch


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    sm_scale: float | None = None) -> torch.Tensor:
    """The seeds' naive attention on [B, H, S, D]: three kernels, two S x S intermediates."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-1, -2)) * sm_scale
    if causal:
        seq_len = q.shape[-2]
        causal_mask = torch.triu(torch.ones((seq_len, seq_len), device=q.device, dtype=torch.bool),
                                 diagonal=1)
        scores = scores.masked_fill(causal_mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(dtype=q.dtype)
    return torch.matmul(probs, v)


def causal_visible(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """[Sq, Sk] bool: query i sees key j when j <= i + (Sk - Sq) (bottom-right alignment)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  sm_scale: float | None = None, compute_dtype: torch.dtype | None = torch.float64,
                  return_lse: bool = False, max_scores: int = 2**28):
    """Reference attention on [B, H, S, D] with GQA, bottom-right causal and empty rows.

    compute_dtype=None computes like PyTorch attention in the input dtype: matmuls in that dtype,
    softmax in float32 (the seeds' naive recipe). Returns out in ``compute_dtype`` (or q's dtype), and
    with ``return_lse`` the natural-log LSE [B, H, Sq] in float32 (float64 when compute_dtype is).
    Query rows are processed in chunks so that at most ``max_scores`` scores exist at once (long
    sequences on the GPU); chunking does not change any value.
    """
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    mm_dtype = compute_dtype or q.dtype
    soft_dtype = compute_dtype or torch.float32
    batch, heads, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    kc, vc = k.to(mm_dtype), v.to(mm_dtype)
    rows = max(1, max_scores // max(1, batch * heads * seqlen_k))
    outs, lses = [], []
    for r0 in range(0, seqlen_q, rows):
        qc = q[:, :, r0:r0 + rows].to(mm_dtype)
        scores = torch.matmul(qc, kc.transpose(-1, -2)).to(soft_dtype) * sm_scale   # [B, H, rows, Sk]
        if causal:
            visible = causal_visible(seqlen_q, seqlen_k, device=q.device)[r0:r0 + rows]
            scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)                                          # [B, H, rows]
        empty = torch.isneginf(lse)
        probs = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])            # 0 on empty rows
        outs.append(torch.matmul(probs.to(mm_dtype), vc))
        lses.append(lse)
    out = torch.cat(outs, dim=2) if outs else q.new_zeros(q.shape, dtype=mm_dtype)
    if return_lse:
        lse = torch.cat(lses, dim=2) if lses else q.new_zeros((batch, heads, 0), dtype=soft_dtype)
        return out, lse
    return out


def flash_attn_ref(q, k, v, causal=False, softmax_scale=None, compute_dtype=torch.float64,
                   return_lse=False):
    """``attention_ref`` for FlashAttention's layout: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]."""
    res = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, softmax_scale,
                        compute_dtype, return_lse)
    if return_lse:
        return res[0].transpose(1, 2), res[1]
    return res.transpose(1, 2)
