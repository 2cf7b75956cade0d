"""T3 (warm-up): a tiled matrix product with tl.dot, C = A @ B.

Program (i, j) owns the [BLOCK_M, BLOCK_N] tile of C at block row i, block column j. It walks the
shared dimension K in steps of BLOCK_K, loading one tile of A and one of B per step and adding their
product into an fp32 accumulator; C's tile is written once at the end. Every operand is addressed
through its strides, so B may be a transposed view (B = W.T with W contiguous): no copy is made, the
tile is simply read with the other stride. T4 and T5 read K^T this way.
Lesson: drills/content/{en,zh}/t3_matmul.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drill_common import dot_operand, require_written, upcast_for_dot


@triton.jit
def _matmul_kernel(
    A, B, C,                            # a [M, K], b [K, N], c [M, N]; fp16 or bf16
    M, N, K,
    stride_am, stride_ak,               # strides in elements, any of them may be 1
    stride_bk, stride_bn,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,   # powers of two >= 16
    UPCAST: tl.constexpr,               # interpreter + bf16: widen dot operands (drill_common)
):
    """Program (pid_m, pid_n): C[rows, cols] = sum over k-blocks of A[rows, ks] @ B[ks, cols], fp32
    accumulator, rows/cols/ks past M/N/K masked (loaded as 0), stored in C's dtype."""
    # Plan:
    # 1. pid_m, pid_n = program ids 0 and 1; rows = pid_m * BLOCK_M + arange, cols likewise
    # 2. acc = zeros [BLOCK_M, BLOCK_N] fp32
    # 3. for each k0 in 0, BLOCK_K, ... < K: load A tile [BLOCK_M, BLOCK_K] and B tile [BLOCK_K, BLOCK_N]
    #    through their strides, out-of-range entries 0; acc = tl.dot(a, b, acc)
    # 4. store acc in C's dtype where rows < M and cols < N
    # [drill:t3:tile]
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                          # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                          # [BLOCK_N]
    ks = tl.arange(0, BLOCK_K)                                              # [BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # [/drill:t3:tile]
    # [drill:t3:k-loop]
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(A + rows[:, None] * stride_am + (k0 + ks)[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & ((k0 + ks)[None, :] < K), other=0.0)   # [BLOCK_M, BLOCK_K]
        b = tl.load(B + (k0 + ks)[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=((k0 + ks)[:, None] < K) & (cols[None, :] < N), other=0.0)   # [BLOCK_K, BLOCK_N]
        acc = tl.dot(dot_operand(a, UPCAST), dot_operand(b, UPCAST), acc)
    # [/drill:t3:k-loop]
    # [drill:t3:store]
    c_ptrs = C + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))
    # [/drill:t3:store]


# [drill:t3:host]
def matmul(a: torch.Tensor, b: torch.Tensor, block_m: int = 32, block_n: int = 32,
           block_k: int = 16) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N] in a's dtype; a and b may have any strides (views, transposes)."""
    require_written(_matmul_kernel, where="drills/mine/t3_matmul.py")
    assert a.ndim == 2 and b.ndim == 2 and a.shape[1] == b.shape[0] and a.dtype == b.dtype
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _matmul_kernel[grid](a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         UPCAST=upcast_for_dot(a.dtype))
    return c
# [/drill:t3:host]
