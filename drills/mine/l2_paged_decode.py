# Your copy of this drill. Write the bodies marked TODO, then run
#     python -m pytest drills/tests/test_l2_paged_decode.py
# The lesson: drills/content/en/l2_paged_decode.md (中文: drills/content/zh/l2_paged_decode.md).
# Reset this file to the untouched stub: python drills/make_mine.py --only l2_paged_decode
"""L2: decode over a paged KV cache. One new query token per sequence attends to that sequence's cached
keys, which live in fixed-size pages scattered through a shared pool.

k_cache, v_cache [num_pages, PAGE_SIZE, Hkv, D]: the pool. block_table [B, max_pages] int32: key j of
sequence b sits at page block_table[b, j // PAGE_SIZE], slot j % PAGE_SIZE. seqlens [B]: how many keys
each sequence has (0 allowed: that sequence's rows see nothing and get out = 0, lse = -inf).

One program per (sequence, K/V head). GQA: the Hq / Hkv query heads that share a K/V head become the
rows of one tile, so each K/V page is read once for the whole group. Decode is bound by reading K and V
(one query row does 2 flops per byte), so that read-once is the whole game.
Lesson: drills/content/{en,zh}/l2_paged_decode.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from drill_common import dot_operand, next_pow2, require_written, upcast_for_dot


@triton.jit
def _paged_decode_kernel(
    Q, K, V, O, LSE,                    # q, o [B, Hq, D]; k, v [num_pages, PAGE_SIZE, Hkv, D]; lse [B, Hq] fp32
    BT, SEQLENS,                        # block_table [B, max_pages] int32, seqlens [B] int32
    stride_qb, stride_qh,               # strides in elements; head_dim stride is 1 everywhere
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ob, stride_oh,
    stride_bt,                          # block_table's row stride
    PAGE_SIZE, sm_scale,                # PAGE_SIZE is a runtime value: any page size, no recompile
    GROUP: tl.constexpr,                # Hq // Hkv query heads per K/V head
    BLOCK_H: tl.constexpr,              # rows of the tile: a power of two >= max(GROUP, 16)
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (b, h_kv): rows r < GROUP are query heads h = h_kv * GROUP + r of sequence b.
    o[b, h] = softmax(q[b, h] K_b^T * sm_scale) V_b over the seqlens[b] keys gathered page by page;
    lse[b, h] its natural-log log-sum-exp; seqlens[b] == 0 gives o = 0, lse = -inf."""
    # TODO: write this function. What it computes:
    # 1. b, h_kv = program ids 0, 1; heads = h_kv * GROUP + arange(BLOCK_H), rows < GROUP are real
    # 2. load q [BLOCK_H, HEAD_DIM] (padding rows as 0); seqlen = seqlens[b]; m = -inf, l = 0, acc = 0
    # 3. for start in 0, BLOCK_N, ... < seqlen: pos = start + arange(BLOCK_N), valid = pos < seqlen;
    #    page = block_table[b, pos // PAGE_SIZE] (masked: never read entries past the sequence);
    #    slot = pos % PAGE_SIZE; key address = page * stride_kp + slot * stride_ks + h_kv * stride_kh (int64);
    #    gather k^T [HEAD_DIM, BLOCK_N] and v [BLOCK_N, HEAD_DIM] (invalid keys as 0)
    # 4. s = q @ k^T, -inf where not valid; online softmax in exp2 as in T5 (m in raw units)
    # 5. rows that saw no key (l == 0): o = 0 and lse = -inf (never 0 / 0); store the GROUP real rows
    # Delete the line below when you start; the tests will then run your code.
    tl.static_assert(False, "_paged_decode_kernel: not written yet")
    # [/drill:l2:empty-rows]


# [drill:l2:host]
def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seqlens: torch.Tensor, sm_scale: float | None = None, block_n: int = 16,
                 return_lse: bool = False):
    """q [B, Hq, D]; k_cache, v_cache [num_pages, page_size, Hkv, D] (any page size); block_table
    [B, max_pages] int32; seqlens [B] int32. Returns o [B, Hq, D] (and lse [B, Hq] fp32)."""
    require_written(_paged_decode_kernel, where="drills/mine/l2_paged_decode.py")
    B, Hq, D = q.shape
    _, page_size, Hkv, _ = k_cache.shape
    assert Hq % Hkv == 0, f"heads: Hq ({Hq}) must be a multiple of Hkv ({Hkv})"
    assert D in (16, 32, 64, 128) and q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert block_table.dtype == torch.int32 and seqlens.dtype == torch.int32 and block_table.stride(1) == 1
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    group = Hq // Hkv
    o = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(B, Hkv)](
        q, k_cache, v_cache, o, lse, block_table, seqlens, *q.stride()[:2], *k_cache.stride()[:3],
        *v_cache.stride()[:3], *o.stride()[:2], block_table.stride(0), page_size, sm_scale,
        GROUP=group, BLOCK_H=max(16, next_pow2(group)), HEAD_DIM=D, BLOCK_N=block_n,
        UPCAST=upcast_for_dot(q.dtype))
    return (o, lse) if return_lse else o
# [/drill:l2:host]
