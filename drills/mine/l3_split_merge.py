# Your copy of this drill. Write the bodies marked TODO, then run
#     python -m pytest drills/tests/test_l3_split_merge.py
# The lesson: drills/content/en/l3_split_merge.md (中文: drills/content/zh/l3_split_merge.md).
# Reset this file to the untouched stub: python drills/make_mine.py --only l3_split_merge
"""L3: split-KV decode and the LSE merge.

At batch 1 with a long context, L2's grid has only B * Hkv programs: a handful, on a GPU with 100+ SMs.
Split-KV cuts each sequence's keys into NUM_SPLITS chunks and gives each chunk its own program. Each
writes a partial result normalised by its own sum, (o_n, lse_n), in fp32. The merge kernel then
combines the partials of a row exactly:

    lse = M + log(sum_n exp(lse_n - M)),  M = max_n lse_n
    o   = sum_n exp(lse_n - lse) * o_n

A chunk that saw no key has lse_n = -inf: weight 0, and its o_n is never read. A row whose every chunk
is empty gets o = 0, lse = -inf. The cache here is contiguous, FlashAttention's [B, S_max, Hkv, D].
Lesson: drills/content/{en,zh}/l3_split_merge.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from drill_common import dot_operand, next_pow2, require_written, upcast_for_dot


@triton.jit
def _split_kv_kernel(
    Q, K, V, O_PART, LSE_PART,          # q [B, Hq, D]; k, v [B, S_max, Hkv, D]; o_part [N, B, Hq, D] fp32;
    SEQLENS,                            # lse_part [N, B, Hq] fp32 (both contiguous); seqlens [B] int32
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    CHUNK, sm_scale,                    # keys per split (a multiple of BLOCK_N)
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (b, h_kv, split): the GROUP query heads of K/V head h_kv against keys
    [split * CHUNK, min((split + 1) * CHUNK, seqlens[b])): o_part = that chunk's softmax-weighted mean
    of v (fp32), lse_part its natural-log log-sum-exp; an empty chunk writes o_part = 0, lse_part = -inf."""
    # TODO: write this function. What it computes:
    # 1. b, h_kv, split = program ids 0, 1, 2; B, Hkv = num_programs(0), num_programs(1); heads as in L2
    # 2. load q [BLOCK_H, HEAD_DIM]; key range lo = split * CHUNK, hi = min(lo + CHUNK, seqlens[b])
    # 3. loop over [lo, hi) in BLOCK_N keys exactly as L2 (contiguous cache: address = b * stride_kb +
    #    pos * stride_ks + h_kv * stride_kh), mask pos < hi, online softmax in exp2
    # 4. o = acc / l (0 if l == 0), lse = m * scale + ln(l) (-inf if l == 0); rows of partial `split`
    #    start at ((split * B + b) * Hq + head) in lse_part, times HEAD_DIM in o_part
    # Delete the line below when you start; the tests will then run your code.
    tl.static_assert(False, "_split_kv_kernel: not written yet")
    # [/drill:l3:partial-store]


@triton.jit
def _merge_kernel(
    O_PART, LSE_PART, O, LSE,           # o_part [N, R, D] fp32, lse_part [N, R] fp32 -> o [R, D], lse [R] fp32
    N, R,                               # number of partials, rows (all contiguous)
    HEAD_DIM: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,         # a power of two >= N
):
    """Program r: lse[r] = log(sum_n exp(lse_part[n, r])) computed around M = max_n lse_part[n, r];
    o[r] = sum_n exp(lse_part[n, r] - lse[r]) * o_part[n, r] (o_part of a -inf partial never read);
    every partial -inf: o[r] = 0, lse[r] = -inf."""
    # TODO: write this function. What it computes:
    # 1. r = program id 0; splits = arange(BLOCK_SPLITS), lanes >= N masked (lse -inf)
    # 2. load lse_n [BLOCK_SPLITS]; M = max; if M is -inf use 0 instead (so -inf - M is -inf, not NaN)
    # 3. w_n = exp(lse_n - M) (0 for empty partials); total = sum w_n
    # 4. load o_n [BLOCK_SPLITS, HEAD_DIM] only where w_n > 0 (other 0); o = sum_n w_n o_n / total
    #    (0 when total == 0); lse = M + log(total) (-inf when total == 0); store o in o's dtype
    # Delete the line below when you start; the tests will then run your code.
    tl.static_assert(False, "_merge_kernel: not written yet")
    # [/drill:l3:merge-combine]


# [drill:l3:host]
def merge_states(o_part: torch.Tensor, lse_part: torch.Tensor, out_dtype: torch.dtype = torch.float32):
    """o_part [N, ..., D], lse_part [N, ...] (fp32) -> (o [..., D] in out_dtype, lse [...] fp32)."""
    require_written(_merge_kernel, where="drills/mine/l3_split_merge.py")
    N, D = o_part.shape[0], o_part.shape[-1]
    assert lse_part.shape == o_part.shape[:-1] and D in (16, 32, 64, 128)
    o_part, lse_part = o_part.float().contiguous(), lse_part.float().contiguous()
    R = lse_part[0].numel()
    o = torch.empty(o_part.shape[1:], dtype=out_dtype, device=o_part.device)
    lse = torch.empty(lse_part.shape[1:], dtype=torch.float32, device=o_part.device)
    if R:
        _merge_kernel[(R,)](o_part, lse_part, o, lse, N, R, HEAD_DIM=D, BLOCK_SPLITS=next_pow2(N))
    return o, lse


def split_kv_partials(q, k, v, seqlens, num_splits: int, sm_scale=None, block_n: int = 16):
    """q [B, Hq, D]; k, v [B, S_max, Hkv, D]; seqlens [B] int32 -> o_part [N, B, Hq, D], lse_part [N, B, Hq]."""
    require_written(_split_kv_kernel, where="drills/mine/l3_split_merge.py")
    B, Hq, D = q.shape
    _, s_max, Hkv, _ = k.shape
    assert Hq % Hkv == 0 and D in (16, 32, 64, 128) and seqlens.dtype == torch.int32
    assert q.stride(2) == 1 and k.stride(3) == 1 and v.stride(3) == 1
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    group = Hq // Hkv
    chunk = triton.cdiv(triton.cdiv(max(s_max, 1), num_splits), block_n) * block_n
    o_part = torch.empty(num_splits, B, Hq, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(num_splits, B, Hq, dtype=torch.float32, device=q.device)
    _split_kv_kernel[(B, Hkv, num_splits)](
        q, k, v, o_part, lse_part, seqlens, *q.stride()[:2], *k.stride()[:3], *v.stride()[:3],
        chunk, sm_scale, GROUP=group, BLOCK_H=max(16, next_pow2(group)), HEAD_DIM=D, BLOCK_N=block_n,
        UPCAST=upcast_for_dot(q.dtype))
    return o_part, lse_part


def split_kv_decode(q, k, v, seqlens, num_splits: int, sm_scale=None, block_n: int = 16):
    """Decode with split-KV: partials, then the merge. Returns (o [B, Hq, D] in q's dtype, lse [B, Hq])."""
    o_part, lse_part = split_kv_partials(q, k, v, seqlens, num_splits, sm_scale, block_n)
    return merge_states(o_part, lse_part, out_dtype=q.dtype)
# [/drill:l3:host]
