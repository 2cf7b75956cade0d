"""Plain PyTorch attention with triflash's semantics, for tests and benchmarks.

* ``naive_attention``: the seeds' naive version, verbatim in spirit: materialises the S x S scores and
  probabilities, softmax in fp32, matmuls in the input dtype. Square causal only (Sq == Sk), one K/V
  head per query head. This is the baseline the benchmark compares against.
* ``attention_ref``: the same semantics as ``triflash.attention`` ([B, H, S, D]): GQA/MQA,
  bottom-right causal for Sq != Sk, rows that see no key give out = 0 and lse = -inf. It computes in
  ``compute_dtype``: float64 for the "truth", or the input dtype to measure how far PyTorch's own
  same-precision attention lands from the truth (the tests' tolerance is relative to that).
* ``flash_attn_ref``: the same in FlashAttention's [B, S, H, D] layout.

All three reference functions take the score variants of the public API: ``softcap`` (scores become
softcap * tanh(s / softcap), before masking), ``alibi_slopes`` ([H] or [B, H]: the bias
-slope * |i + Sk - Sq - j| after the cap) and ``sinks`` ([H]: one more logit per head in every row's
softmax, with no value; the LSE includes it; a row that sees no key gets out 0 and lse = sink).
They are differentiable in ``sinks`` (the tests take dsink from autograd through them).
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


def causal_visible(seqlen_q: int, seqlen_k: int, device=None, window_size=(-1, -1),
                   causal: bool = True, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """[Sq, Sk] bool: query i sees key j when j <= i + (Sk - Sq) (bottom-right alignment). With a
    ``window_size`` (left, right), also when i + off - left <= j <= i + off + right (-1: that side
    unbounded); ``causal=False`` drops the causal bound, keeping the window's. ``rows`` (r0, r1): only
    those query rows, [r1 - r0, Sk]."""
    r0, r1 = rows if rows is not None else (0, seqlen_q)
    i = torch.arange(r0, r1, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    off = seqlen_k - seqlen_q
    visible = j <= i + off if causal else torch.ones(r1 - r0, seqlen_k, dtype=torch.bool, device=device)
    left, right = window_size
    if left >= 0:
        visible = visible & (j >= i + off - left)
    if right >= 0:
        visible = visible & (j <= i + off + right)
    return visible


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  sm_scale: float | None = None, compute_dtype: torch.dtype | None = torch.float64,
                  return_lse: bool = False, max_scores: int = 2**28, window_size=(-1, -1), softcap: float = 0.0,
                  alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                  row_span: tuple[int, int] | None = None):
    """Reference attention on [B, H, S, D] with GQA, bottom-right causal, a local window
    (``window_size``, see ``causal_visible``), empty rows and the score variants (module docstring).

    compute_dtype=None computes like PyTorch attention in the input dtype: matmuls in that dtype,
    softmax in float32 (the seeds' naive recipe). Returns out in ``compute_dtype`` (or q's dtype), and
    with ``return_lse`` the natural-log LSE [B, H, Sq] in float32 (float64 when compute_dtype is).
    Query rows are processed in chunks so that at most ``max_scores`` scores exist at once (long
    sequences on the GPU); chunking does not change any value. ``row_span`` (start, total): q holds
    rows [start, start + Sq) of a problem of ``total`` query rows (masks and ALiBi's distances are
    that problem's), so a caller can take autograd through one slice of rows at a time.
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
    start, total_q = row_span if row_span is not None else (0, seqlen_q)
    if not (isinstance(start, int) and isinstance(total_q, int) and 0 <= start and start + seqlen_q <= total_q):
        raise ValueError(f"row_span must be (start, total) with 0 <= start and start + q's {seqlen_q} rows <= "
                         f"total; got {row_span!r}")
    kc, vc = k.to(mm_dtype), v.to(mm_dtype)
    rows = max(1, max_scores // max(1, batch * heads * seqlen_k))
    outs, lses = [], []
    for r0 in range(0, seqlen_q, rows):
        qc = q[:, :, r0:r0 + rows].to(mm_dtype)
        scores = torch.matmul(qc, kc.transpose(-1, -2)).to(soft_dtype) * sm_scale   # [B, H, rows, Sk]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if alibi_slopes is not None:
            slopes = alibi_slopes.to(soft_dtype)
            slopes = (slopes[None] if slopes.dim() == 1 else slopes)[:, :, None, None]       # [B or 1, H, 1, 1]
            i = torch.arange(start + r0, start + min(r0 + rows, seqlen_q), device=q.device)[:, None]
            j = torch.arange(seqlen_k, device=q.device)[None, :]
            scores = scores - slopes * (i + seqlen_k - total_q - j).abs().to(soft_dtype)
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
        if causal or tuple(window_size) != (-1, -1):
            visible = causal_visible(total_q, seqlen_k, q.device, window_size, causal,
                                     rows=(start + r0, start + min(r0 + rows, seqlen_q)))
        if sinks is not None:
            # The sink: one more column in every row's softmax, dropped from the probabilities. A row
            # that sees no key then has p_sink = 1: out = 0, lse = sink.
            scores = scores.masked_fill(~visible, float("-inf"))
            sink_col = sinks.to(soft_dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
            scores = torch.cat([scores, sink_col], dim=-1)
            lses.append(torch.logsumexp(scores, dim=-1))
            probs = torch.softmax(scores, dim=-1)[..., :-1]
            outs.append(torch.matmul(probs.to(mm_dtype), vc))
            continue
        # Rows that see no key: softmax over a row of zeros, then multiplied by 0. The result is
        # out = 0, lse = -inf, and (unlike a softmax over -inf) gradients of 0 instead of NaN.
        empty = ~visible.any(dim=-1)                                                   # [rows]
        scores = scores.masked_fill(~visible | empty[:, None], float("-inf"))
        scores = scores.masked_fill(empty[:, None], 0.0)
        lse = torch.logsumexp(scores, dim=-1)                                          # [B, H, rows]
        probs = torch.softmax(scores, dim=-1) * (~empty)[:, None]
        outs.append(torch.matmul(probs.to(mm_dtype), vc))
        lses.append(lse.masked_fill(empty, float("-inf")))
    out = torch.cat(outs, dim=2) if outs else q.new_zeros(q.shape, dtype=mm_dtype)
    if return_lse:
        lse = torch.cat(lses, dim=2) if lses else q.new_zeros((batch, heads, 0), dtype=soft_dtype)
        return out, lse
    return out


def flash_attn_ref(q, k, v, causal=False, softmax_scale=None, compute_dtype=torch.float64,
                   return_lse=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                   row_span=None):
    """``attention_ref`` for FlashAttention's layout: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]."""
    res = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, softmax_scale,
                        compute_dtype, return_lse, window_size=window_size, softcap=softcap,
                        alibi_slopes=alibi_slopes, sinks=sinks, row_span=row_span)
    if return_lse:
        return res[0].transpose(1, 2), res[1]
    return res.transpose(1, 2)


# --------------------------------------------------------------------------------------------------
# KV cache (decode) and merging partial states
# --------------------------------------------------------------------------------------------------

def gather_kv_cache(cache: torch.Tensor, seqlen: int, batch_index: int,
                    block_table: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``seqlen`` keys (or values) of sequence ``batch_index`` as a contiguous
    [seqlen, heads_kv, head_dim] tensor: from a contiguous cache [B, S_max, Hkv, D], or from a paged
    cache [num_pages, page_size, Hkv, D] through block_table [B, max_pages] (key j at page
    block_table[b, j // page_size], slot j % page_size)."""
    if block_table is None:
        return cache[batch_index, :seqlen].contiguous()
    page_size = cache.shape[1]
    pos = torch.arange(seqlen, device=cache.device)
    pages = block_table[batch_index].long()[pos // page_size]
    return cache[pages, pos % page_size]


def kvcache_ref(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                softmax_scale=None, causal=False, compute_dtype=torch.float64, return_lse=False,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None):
    """``flash_attn_with_kvcache``'s semantics in plain PyTorch, built on ``attention_ref``.

    The caches are not modified: appended k/v (if given) are concatenated after each sequence's
    cache_seqlens[b] cached keys. Each sequence is attended separately with its own length (so causal
    masking is bottom-right aligned per sequence). Returns out [B, Sq, Hq, D] in ``compute_dtype``
    (or q's dtype) and, with ``return_lse``, lse [B, Hq, Sq].
    """
    batch = q.shape[0]
    if cache_seqlens is None:
        lengths = [k_cache.shape[1]] * batch
    elif isinstance(cache_seqlens, int):
        lengths = [cache_seqlens] * batch
    else:
        lengths = [int(x) for x in cache_seqlens.tolist()]
    outs, lses = [], []
    for b in range(batch):
        kb = gather_kv_cache(k_cache, lengths[b], b, block_table)          # [L, Hkv, D]
        vb = gather_kv_cache(v_cache, lengths[b], b, block_table)
        if k is not None:
            kb = torch.cat([kb, k[b]], dim=0)
            vb = torch.cat([vb, v[b]], dim=0)
        slopes = alibi_slopes[b:b + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        out, lse = flash_attn_ref(q[b:b + 1], kb[None], vb[None], causal=causal,
                                  softmax_scale=softmax_scale, compute_dtype=compute_dtype,
                                  return_lse=True, window_size=window_size, softcap=softcap,
                                  alibi_slopes=slopes, sinks=sinks)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs, dim=0)
    if return_lse:
        return out, torch.cat(lses, dim=0)
    return out


def merge_attn_states_ref(out_partials, lse_partials):
    """``merge_attn_states`` in float64: out_partials [N, B, S, H, D], lse_partials [N, B, H, S].
    Returns (out [B, S, H, D], lse [B, H, S]), both float64; rows with every lse = -inf give 0, -inf."""
    if isinstance(out_partials, (list, tuple)):
        out_partials = torch.stack(list(out_partials))
    if isinstance(lse_partials, (list, tuple)):
        lse_partials = torch.stack(list(lse_partials))
    lse_parts = lse_partials.double()                                     # [N, B, H, S]
    lse = torch.logsumexp(lse_parts, dim=0)                               # [B, H, S]
    empty = torch.isneginf(lse)
    weights = torch.exp(lse_parts - torch.where(empty, 0.0, lse))         # 0 for empty parts
    weights = weights.permute(0, 1, 3, 2)[..., None]                      # [N, B, S, H, 1]
    parts = torch.where(weights > 0, out_partials.double(), 0.0)          # never read an empty part
    return (weights * parts).sum(dim=0), lse
