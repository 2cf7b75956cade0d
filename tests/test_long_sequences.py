"""Long sequences (S = 4096 and 16384) in fp16 and bf16: GPU only, too slow for the interpreter."""

import pytest
import torch
from conftest import ON_GPU
from helpers import assert_2x_rule, assert_matches_reference, make_qkv

import triflash
from triflash.reference import flash_attn_ref

pytestmark = pytest.mark.skipif(not ON_GPU, reason="long sequences run on the GPU only (interpreter too slow)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch,seqlen,heads_q,heads_kv,head_dim", [
    pytest.param(2, 4096, 4, 4, 64, id="B2-S4096-D64"),
    pytest.param(1, 4096, 6, 2, 128, id="B1-S4096-D128-gqa3"),
    pytest.param(1, 16384, 2, 2, 64, id="B1-S16384-D64"),
    pytest.param(1, 16384, 2, 1, 128, id="B1-S16384-D128-mqa"),
])
def test_long_sequence(device, batch, seqlen, heads_q, heads_kv, head_dim, causal, dtype):
    q, k, v = make_qkv(batch, seqlen, seqlen, heads_q, heads_kv, head_dim, dtype, device)
    out, lse = triflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert_matches_reference(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(4096, 16384), (16384, 4096), (4095, 4097)])
def test_long_unequal_causal(device, seqlen_q, seqlen_k):
    dtype = torch.bfloat16
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 2, 64, dtype, device)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert_matches_reference(out, lse, q, k, v, causal=True)


def test_many_heads_grid(device):
    """B*H beyond CUDA's 65535 limit on grid y/z: the 1-D grid has no such limit."""
    q = torch.randn(70000, 16, 1, 16, dtype=torch.float16, device=device)
    out, lse = triflash.flash_attn_func(q, q, q, causal=True, return_lse=True)
    ref = flash_attn_ref(q[-100:], q[-100:], q[-100:], causal=True)
    same = flash_attn_ref(q[-100:], q[-100:], q[-100:], causal=True, compute_dtype=None)
    assert_2x_rule("out", out[-100:], ref, same, torch.float16)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(4, 4099), (4096, 4096)])
def test_long_fp32(device, seqlen_q, seqlen_k):
    """fp32 is held to fp32 PyTorch: long key ranges stress the row sum and the LSE's one log."""
    dtype = torch.float32
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 8, 1, 40, dtype, device)
    out, lse = triflash.flash_attn_func(q, k, v, return_lse=True)
    assert_matches_reference(out, lse, q, k, v)
