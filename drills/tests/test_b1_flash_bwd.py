"""B1: FlashAttention backward (dQ, dK, dV) against float64 autograd of the reference.

Rule: each gradient's max error vs float64 <= 3 x PyTorch's own same-dtype autograd error + a floor
relative to the largest gradient (drill_helpers explains why 3x for gradients). The forward's O and LSE
are taken from the float64 reference, so this drill does not depend on your T5.
"""

import pytest
import torch
from conftest import load_drill
from drill_helpers import FLOOR, assert_close_2x, randn
from drill_reference import attention_ref

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture(scope="module")
def b1(target):
    return load_drill(target, "b1_flash_bwd")


def ref_grads(q, k, v, do, causal, compute_dtype):
    leaves = [t.detach().to(compute_dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out = attention_ref(*leaves, causal=causal, compute_dtype=compute_dtype)
    out.backward(do.to(out.dtype))
    return [t.grad for t in leaves]


def check(b1, B, H, S, D, causal, dtype, device, block_m=32, block_n=32, seed=0):
    q, k, v, do = (randn(B, H, S, D, dtype=dtype, device=device, seed=seed + i) for i in range(4))
    o64, lse64 = attention_ref(q, k, v, causal=causal, return_lse=True)
    grads = b1.flash_attn_backward(do, q, k, v, o64.to(dtype), lse64.float(), causal=causal,
                                   block_m=block_m, block_n=block_n)
    ref = ref_grads(q, k, v, do, causal, torch.float64)
    same = ref_grads(q, k, v, do, causal, None)
    largest = max(r.abs().max().item() for r in ref)
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, ref, same):
        assert g.dtype == dtype, name
        assert_close_2x(name, g, r, s, FLOOR[dtype] * max(1.0, largest), factor=3.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("S, D", [(64, 32), (45, 16)], ids=["S64-D32", "ragged-S45-D16"])
def test_backward(b1, device, S, D, causal):
    check(b1, 1, 2, S, D, causal, F16, device)


def test_causal_blocks_differ(b1, device):
    """Causal with BLOCK_M != BLOCK_N: the dK/dV loop's first query block and the dQ loop's last key
    block must be derived from the right block size."""
    check(b1, 1, 1, 70, 16, True, F16, device, block_m=16, block_n=32)
    check(b1, 1, 1, 70, 16, True, F16, device, block_m=32, block_n=16)


def test_bf16(b1, device):
    check(b1, 1, 2, 48, 32, True, BF16, device)
