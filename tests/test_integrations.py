"""triflash behind SDPA: the strict drop-in and the routing context manager (integrations.py)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_2x_rule

import triflash
from triflash.integrations import scaled_dot_product_attention as tf_sdpa
from triflash.integrations import sdpa_routed_to_triflash
from triflash.reference import flash_attn_ref


def _qkv(shape_q, shape_kv, dtype, device, requires_grad=False):
    make = lambda shape: torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)  # noqa: E731
    return make(shape_q), make(shape_kv), make(shape_kv)


def _as_bshd(t):
    """[..., H, L, E] (any rank >= 3) -> [N, L, H, E] for the reference."""
    t = t.unsqueeze(-3) if t.dim() == 3 else t
    return t.reshape(-1, *t.shape[-3:]).transpose(1, 2)


@pytest.mark.parametrize("shape_q,shape_kv,causal,gqa", [
    pytest.param((2, 4, 33, 64), (2, 4, 33, 64), True, False, id="4d-causal"),
    pytest.param((2, 6, 17, 32), (2, 2, 40, 32), False, True, id="4d-gqa-L17-S40"),
    pytest.param((3, 21, 16), (3, 30, 16), False, False, id="3d"),
    pytest.param((2, 2, 3, 9, 32), (2, 2, 3, 9, 32), True, False, id="5d-causal"),
])
def test_drop_in_matches_sdpa_semantics(device, shape_q, shape_kv, causal, gqa):
    q, k, v = _qkv(shape_q, shape_kv, torch.float16, device)
    out = tf_sdpa(q, k, v, is_causal=causal, scale=0.2, enable_gqa=gqa)
    assert out.shape == shape_q[:-1] + (v.shape[-1],)
    ref = flash_attn_ref(_as_bshd(q), _as_bshd(k), _as_bshd(v), causal=causal, softmax_scale=0.2)
    same = flash_attn_ref(_as_bshd(q), _as_bshd(k), _as_bshd(v), causal=causal, softmax_scale=0.2,
                          compute_dtype=None)
    assert_2x_rule("out", _as_bshd(out), ref, same, torch.float16)


def test_drop_in_gradients_are_triflash_attentions(device):
    """Gradients flow as through triflash.attention (the same kernels: the same bits)."""
    q, k, v = _qkv((2, 4, 20, 32), (2, 2, 20, 32), torch.float32, device, requires_grad=True)
    out = tf_sdpa(q, k, v, is_causal=True, enable_gqa=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out2 = triflash.attention(*leaves, causal=True)
    grads2 = torch.autograd.grad(out2, leaves, dout)
    assert torch.equal(out, out2)
    for g, g2 in zip(grads, grads2):
        assert torch.equal(g, g2)


@pytest.mark.parametrize("kwargs,words", [
    pytest.param({"attn_mask": "mask"}, ["attn_mask"], id="mask"),
    pytest.param({"dropout_p": 0.1}, ["dropout_p", "0.1"], id="dropout"),
    pytest.param({"is_causal": True, "L": 5}, ["is_causal", "L=5", "S=8", "top-left"], id="causal-L-ne-S"),
    pytest.param({"E_v": 16}, ["v must have the same shape as k", "(1, 4, 8, 32)", "(1, 4, 8, 16)"], id="value-dim"),
    pytest.param({"H_kv": 2}, ["enable_gqa", "4 heads", "2"], id="gqa-not-enabled"),
    pytest.param({"S": 0}, ["S = 0", "NaN"], id="no-keys"),
])
def test_drop_in_says_what_it_does_not_compute(device, kwargs, words):
    kwargs = dict(kwargs)
    L, S, E_v, H_kv = kwargs.pop("L", 8), kwargs.pop("S", 8), kwargs.pop("E_v", 32), kwargs.pop("H_kv", 4)
    q = torch.randn(1, 4, L, 32, dtype=torch.float16, device=device)
    k = torch.randn(1, H_kv, S, 32, dtype=torch.float16, device=device)
    v = torch.randn(1, H_kv, S, E_v, dtype=torch.float16, device=device)
    if kwargs.get("attn_mask") == "mask":
        kwargs["attn_mask"] = torch.ones(L, S, dtype=torch.bool, device=device)
    with pytest.raises(NotImplementedError) as info:
        tf_sdpa(q, k, v, **kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("shape_q,shape_kv", [
    pytest.param((2, 4, 0, 16), (2, 4, 5, 16), id="L0"),
    pytest.param((2, 4, 0, 16), (2, 4, 0, 16), id="L0-S0"),
    pytest.param((0, 4, 3, 16), (0, 4, 5, 16), id="N0"),
    pytest.param((2, 1, 0, 3, 16), (2, 1, 0, 5, 16), id="5d-H0"),
])
def test_empty_inputs_match_sdpa(device, shape_q, shape_kv):
    """Zero-size dimensions: the same (empty) shapes as SDPA's, through the router."""
    q, k, v = _qkv(shape_q, shape_kv, torch.float32, device)
    expected = F.scaled_dot_product_attention(q, k, v)
    with sdpa_routed_to_triflash():
        got = F.scaled_dot_product_attention(q, k, v)
    assert got.shape == expected.shape


def test_router_leaves_to_torch_what_triflash_refuses(device):
    """A scale triflash's float32 kernels cannot take, or a non-bool is_causal, goes to PyTorch."""
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16), torch.float32, device)
    with sdpa_routed_to_triflash() as counts:
        F.scaled_dot_product_attention(q, k, v, scale=1e-40)
        with pytest.raises((TypeError, RuntimeError)):
            F.scaled_dot_product_attention(q, k, v, is_causal="yes")
    assert counts == {"triflash": 0, "torch": 2, "reasons": {"input triflash refuses: scale": 1,
                                                             "is_causal not a bool": 1}}
    with pytest.raises(NotImplementedError, match="scale"):
        tf_sdpa(q, k, v, scale=1e39)


class _Block(torch.nn.Module):
    """Calls SDPA through torch.nn.functional at call time, as most models do."""

    def forward(self, q, k, v, mask=None, causal=False):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def test_routing_sends_supported_calls_to_triflash_and_the_rest_to_torch(device):
    q, k, v = _qkv((2, 4, 24, 32), (2, 4, 24, 32), torch.float32, device)
    mask = torch.rand(24, 24, device=device) > 0.3
    mask.fill_diagonal_(True)
    block = _Block()
    original = F.scaled_dot_product_attention
    with sdpa_routed_to_triflash() as counts:
        causal = block(q, k, v, causal=True)
        masked = block(q, k, v, mask=mask)
        sliced = block(q, k[:, :, :20], v[:, :, :20], causal=True)       # L != S causal: top-left, torch's
    assert counts == {"triflash": 1, "torch": 2, "reasons": {"attn_mask": 1, "is_causal with L != S": 1}}
    assert F.scaled_dot_product_attention is original
    assert torch.equal(causal, triflash.attention(q, k, v, causal=True))
    assert torch.equal(masked, original(q, k, v, attn_mask=mask))
    assert torch.equal(sliced, original(q, k[:, :, :20], v[:, :, :20], is_causal=True))


def test_routing_restores_sdpa_after_an_error(device):
    original = F.scaled_dot_product_attention
    with pytest.raises(RuntimeError, match="inside"):
        with sdpa_routed_to_triflash():
            assert F.scaled_dot_product_attention is not original
            raise RuntimeError("inside")
    assert F.scaled_dot_product_attention is original


@pytest.mark.parametrize("kwargs,reason", [
    pytest.param({"attn_mask": "mask"}, "attn_mask", id="mask"),
    pytest.param({"dropout_p": 0.1}, "dropout_p", id="dropout"),
    pytest.param({"is_causal": True, "L": 5}, "is_causal with L != S", id="causal-L-ne-S"),
    pytest.param({"H_kv": 2}, "heads differ without enable_gqa", id="gqa-not-enabled"),
    pytest.param({"S": 0}, "no keys", id="no-keys"),
    pytest.param({"dtype": torch.float64}, "input triflash refuses: q.dtype", id="float64"),
])
def test_router_counts_each_reason(device, kwargs, reason):
    """Every call the router leaves to PyTorch is counted under why, in a short stable phrase (the
    same for every call of that kind, whatever its shapes)."""
    kwargs = dict(kwargs)
    L, S, H_kv = kwargs.pop("L", 8), kwargs.pop("S", 8), kwargs.pop("H_kv", 4)
    dtype = kwargs.pop("dtype", torch.float32)
    q = torch.randn(1, 4, L, 16, dtype=dtype, device=device)
    k, v = (torch.randn(1, H_kv, S, 16, dtype=dtype, device=device) for _ in range(2))
    if kwargs.get("attn_mask") == "mask":
        kwargs["attn_mask"] = torch.ones(L, S, dtype=torch.bool, device=device)
    with sdpa_routed_to_triflash() as counts:
        for _ in range(2):
            if H_kv != 4:                    # PyTorch refuses it too: counted, then PyTorch's error
                with pytest.raises(RuntimeError):
                    F.scaled_dot_product_attention(q, k, v, **kwargs)
            else:
                F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert counts == {"triflash": 0, "torch": 2, "reasons": {reason: 2}}
    counts.reset()
    assert counts == {"triflash": 0, "torch": 0, "reasons": {}}
