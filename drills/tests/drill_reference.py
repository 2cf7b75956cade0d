"""Plain PyTorch references for the drill tests (self-contained: the drills do not import triflash).

``compute_dtype=torch.float64`` is the truth. ``compute_dtype=None`` computes like PyTorch attention at
the input dtype (matmuls in that dtype, softmax in fp32): how far *that* lands from the truth is the
yardstick of the 2x rule (drill_helpers).
"""

from __future__ import annotations

import math

import torch


def attention_ref(q, k, v, causal=False, sm_scale=None, compute_dtype=torch.float64, return_lse=False):
    """q [..., Sq, D], k/v [..., Sk, D] (same leading dims). Causal: query i sees key j <= i + (Sk - Sq).
    Rows that see no key give out 0 and lse -inf. Returns out (in compute_dtype or q's dtype) and, with
    return_lse, the natural-log lse [..., Sq] (float64 or float32)."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    mm = compute_dtype or q.dtype
    soft = compute_dtype or torch.float32
    s = torch.matmul(q.to(mm), k.to(mm).transpose(-1, -2)).to(soft) * sm_scale      # [..., Sq, Sk]
    sq, sk = s.shape[-2:]
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        visible = j <= i + (sk - sq)
    empty = ~visible.any(-1)                                                       # [Sq]
    s = s.masked_fill(~visible, float("-inf")).masked_fill(empty[:, None], 0.0)
    lse = torch.logsumexp(s, -1).masked_fill(empty, float("-inf"))
    p = torch.softmax(s, -1) * (~empty)[:, None]
    out = torch.matmul(p.to(mm), v.to(mm))
    return (out, lse) if return_lse else out


def gather_pages(cache, table_row, n):
    """The first n keys (or values) of one sequence of a paged cache [pages, page_size, H, D]."""
    page_size = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    return cache[table_row.long()[pos // page_size], pos % page_size]                # [n, H, D]


def decode_ref(q, k_cache, v_cache, seqlens, block_table=None, sm_scale=None, compute_dtype=torch.float64):
    """One query token per sequence. q [B, Hq, D]; caches paged [pages, page_size, Hkv, D] with block_table
    [B, max_pages], or contiguous [B, S_max, Hkv, D] without. Returns out [B, Hq, D], lse [B, Hq]."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(seqlens[b])
        if block_table is None:
            kb, vb = k_cache[b, :n], v_cache[b, :n]
        else:
            kb, vb = gather_pages(k_cache, block_table[b], n), gather_pages(v_cache, block_table[b], n)
        group = q.shape[1] // kb.shape[1]
        kb = kb.transpose(0, 1).repeat_interleave(group, 0)                        # [Hq, n, D]
        vb = vb.transpose(0, 1).repeat_interleave(group, 0)
        out, lse = attention_ref(q[b][:, None], kb, vb, sm_scale=sm_scale, compute_dtype=compute_dtype,
                                 return_lse=True)
        outs.append(out[:, 0])
        lses.append(lse[:, 0])
    return torch.stack(outs), torch.stack(lses)
