"""T5: FlashAttention forward against the float64 reference, by the 2x rule, output and LSE."""

import math

import pytest
import torch
from conftest import load_drill
from drill_helpers import FLOOR, assert_close_2x, lse_floor, randn
from drill_reference import attention_ref

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture(scope="module")
def t5(target):
    return load_drill(target, "t5_flash_attn")


def check(t5, q, k, v, causal, block_m, block_n, sm_scale=None):
    o, lse = t5.flash_attn(q, k, v, causal=causal, sm_scale=sm_scale, block_m=block_m, block_n=block_n,
                           return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)
    same, same_lse = attention_ref(q, k, v, causal=causal, sm_scale=sm_scale, compute_dtype=None,
                                   return_lse=True)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert_close_2x("out", o, ref, same, FLOOR[q.dtype])
    assert_close_2x("lse", lse, ref_lse, same_lse, lse_floor(ref_lse))


def qkv(B, H, S, D, dtype, device, seed=0):
    return [randn(B, H, S, D, dtype=dtype, device=device, seed=seed + i) for i in range(3)]


# (B, H, S, D, causal, BLOCK_M, BLOCK_N, dtype): each case names the pitfall it guards
CASES = [
    pytest.param(2, 2, 64, 32, False, 32, 32, F16, id="basic-S64-D32"),
    pytest.param(2, 2, 64, 32, True, 32, 32, F16, id="causal-S64"),
    pytest.param(1, 2, 113, 16, False, 32, 16, F16, id="ragged-tail-S113"),
    pytest.param(1, 2, 17, 64, True, 16, 16, F16, id="ragged-tail-causal-S17-D64"),
    pytest.param(1, 2, 100, 16, True, 32, 16, F16, id="causal-BM32-BN16"),
    pytest.param(1, 2, 100, 16, True, 16, 32, F16, id="causal-BM16-BN32"),
    pytest.param(1, 1, 1, 16, True, 16, 16, F16, id="one-token"),
    pytest.param(1, 2, 80, 32, False, 16, 16, BF16, id="bf16"),
    pytest.param(1, 2, 80, 32, True, 32, 16, BF16, id="bf16-causal-BM32-BN16"),
]


@pytest.mark.parametrize("B, H, S, D, causal, block_m, block_n, dtype", CASES)
def test_forward(t5, device, B, H, S, D, causal, block_m, block_n, dtype):
    q, k, v = qkv(B, H, S, D, dtype, device)
    check(t5, q, k, v, causal, block_m, block_n)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_row_max_grows(t5, device, causal):
    """Scores grow block after block: every new block raises the row max, so acc and l must be rescaled
    by alpha each time (forgetting acc * alpha, or computing p from the old max, fails here)."""
    B, H, S, D = 1, 1, 96, 16
    q, k, v = qkv(B, H, S, D, F16, device, seed=3)
    q = q.abs() + 0.5
    ramp = torch.linspace(0.0, 3.0, S, device=device, dtype=torch.float32)[:, None]
    k = (k.float().abs() * 0.3 + ramp).to(F16)           # key j scores ~ j, larger than every earlier one
    check(t5, q, k, v, causal, 16, 16, sm_scale=0.5)


def test_strided_layout(t5, device):
    """[B, S, H, D] memory passed as a [B, H, S, D] view: the kernel walks the strides, no copy."""
    B, H, S, D = 1, 2, 40, 32
    q, k, v = (randn(B, S, H, D, dtype=F16, device=device, seed=7 + i).transpose(1, 2) for i in range(3))
    check(t5, q, k, v, True, 16, 16)


def test_default_scale(t5, device):
    """sm_scale defaults to 1/sqrt(D); scores scaled up (x4) still match."""
    q, k, v = qkv(1, 1, 48, 64, F16, device, seed=11)
    check(t5, q * 2, k * 2, v, False, 16, 16)
    check(t5, q, k, v, False, 16, 16, sm_scale=1.0 / math.sqrt(64))
