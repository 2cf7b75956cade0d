"""Strided inputs are read in place, and give bit-identical results to contiguous copies."""

import pytest
import torch

import triflash


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_packed_qkv_is_bit_identical(device, causal, dtype):
    """q, k, v unbound from one packed [B, S, 3, H, D] tensor (what a fused qkv projection gives)."""
    qkv = torch.randn(2, 77, 3, 4, 64, dtype=dtype, device=device)
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    out, lse = triflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = triflash.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal,
                                            return_lse=True)
    assert torch.equal(out, ref)
    assert torch.equal(lse, ref_lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_transposed_views_are_bit_identical(device, causal):
    """[B, H, S, D] tensors handed to flash_attn_func as transposed views, and the reverse."""
    q = torch.randn(2, 6, 91, 48, dtype=torch.float16, device=device)
    k = torch.randn(2, 3, 130, 48, dtype=torch.float16, device=device)
    v = torch.randn(2, 3, 130, 48, dtype=torch.float16, device=device)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))        # [B, S, H, D] views, not contiguous
    out = triflash.flash_attn_func(qt, kt, vt, causal=causal)
    ref = triflash.flash_attn_func(qt.contiguous(), kt.contiguous(), vt.contiguous(), causal=causal)
    assert torch.equal(out, ref)
    # attention() on views of BSHD tensors
    out2 = triflash.attention(qt.contiguous().transpose(1, 2), kt.contiguous().transpose(1, 2),
                              vt.contiguous().transpose(1, 2), causal=causal)
    assert torch.equal(out2, ref.transpose(1, 2))


def test_inputs_are_not_copied(device, monkeypatch):
    """The launcher gets the caller's storage: no .contiguous() copy of a last-dim-contiguous view."""
    import triflash.autograd as autograd

    seen = {}
    real = autograd.dispatch.forward

    def spy(q, k, v, *args, **kwargs):
        seen["ptrs"] = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(autograd.dispatch, "forward", spy)
    qkv = torch.randn(1, 33, 3, 2, 32, dtype=torch.float16, device=device)
    q, k, v = qkv.unbind(dim=2)
    triflash.flash_attn_func(q, k, v)
    assert seen["ptrs"] == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    triflash.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert seen["ptrs"] == (q.data_ptr(), k.data_ptr(), v.data_ptr())


def test_non_contiguous_head_dim_is_handled(device):
    """A view whose last dim is strided is copied once (the kernel needs unit stride on head_dim)."""
    big = torch.randn(1, 40, 2, 64, dtype=torch.float16, device=device)
    q = big[..., ::2]                                             # head_dim 32, stride 2
    assert q.stride(-1) == 2
    out = triflash.flash_attn_func(q, q, q)
    ref = triflash.flash_attn_func(q.contiguous(), q.contiguous(), q.contiguous())
    assert torch.equal(out, ref)
