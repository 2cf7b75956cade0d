"""Tensors on a GPU that is not the current device: every launcher must run on the tensors' GPU."""

import pytest
import torch
from helpers import assert_matches_reference

import triflash

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def test_forward_backward_decode_on_second_gpu():
    torch.cuda.set_device(0)
    dev = torch.device("cuda:1")
    q = torch.randn(2, 300, 4, 64, device=dev, dtype=torch.float16, requires_grad=True)
    k = torch.randn(2, 300, 2, 64, device=dev, dtype=torch.float16, requires_grad=True)
    v = torch.randn(2, 300, 2, 64, device=dev, dtype=torch.float16, requires_grad=True)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.device == dev and torch.cuda.current_device() == 0
    assert_matches_reference(out, lse, q.detach(), k.detach(), v.detach(), causal=True)
    out.sum().backward()
    assert q.grad.device == dev and not torch.isnan(q.grad).any()
    # decode with split-KV (decode kernel + merge kernel) against the dense forward
    cache_k, cache_v = k.detach(), v.detach()
    q1 = q.detach()[:, -1:]
    dec, dec_lse = triflash.flash_attn_with_kvcache(q1, cache_k, cache_v, num_splits=3, return_lse=True)
    assert dec.device == dev
    assert_matches_reference(dec, dec_lse, q1, cache_k, cache_v)
