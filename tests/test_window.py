"""Local (sliding-window) attention: window_size=(left, right) in flash_attn_func, attention and
flash_attn_varlen_func, forward and backward, against the float64 reference with the same window
(helpers' 2x / 3x rules). Windows run on the Triton kernels on every GPU; the interpreter's tiles
(64 x 32) and the GPU's are both crossed by these sizes, so each of the three key ranges (masked left
edge, whole blocks, masked right edge) and the rows that see no key occur."""

import pytest
import torch
from conftest import DTYPES, ON_GPU
from helpers import (
    DTYPE_ID,
    assert_20_backward_passes_equal,
    assert_grads_3x,
    assert_matches_reference,
    assert_raises_naming,
    make_qkv,
)

import triflash

WINDOWS = [(16, -1), (0, 0), (33, 5), (-1, 7), (100, 100), (0, -1), (200, 3)]
SEQLENS = [(130, 130), (50, 170), (170, 40), (1, 200)]


def _cases():
    cases = []
    for i, ((sq, sk), window, causal) in enumerate(
            (s, w, c) for s in SEQLENS for w in WINDOWS for c in (False, True)):
        if causal and window[1] > 0:
            continue                                   # rejected with causal (tested below)
        dtypes = DTYPES if ON_GPU else [DTYPES[i % len(DTYPES)]]
        for dtype in dtypes:
            cases.append(pytest.param(sq, sk, window, causal, dtype,
                                      id=f"Sq{sq}-Sk{sk}-w{window[0]}_{window[1]}-"
                                         f"{'causal' if causal else 'full'}-{DTYPE_ID[dtype]}"))
    return cases


@pytest.mark.parametrize("seqlen_q,seqlen_k,window,causal,dtype", _cases())
def test_window_forward_and_backward(device, seqlen_q, seqlen_k, window, causal, dtype):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 32 if not ON_GPU else 64, dtype, device, requires_grad=True)
    out, lse = triflash.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    assert_matches_reference(out, lse, q, k, v, causal=causal, window_size=window)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_3x(grads, q, k, v, dout, causal, dtype, window_size=window)


def test_unbounded_window_is_the_plain_kernel(device):
    """(-1, -1), and (-1, 0) with or without causal (both are causal attention), are the plain calls:
    the same bits, forward and backward."""
    q, k, v = make_qkv(1, 70, 90, 2, 1, 32, torch.float16, device, requires_grad=True)
    assert torch.equal(triflash.flash_attn_func(q, k, v, window_size=(-1, -1)), triflash.flash_attn_func(q, k, v))
    causal = triflash.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(causal)
    grads = torch.autograd.grad(causal, (q, k, v), dout)
    for kwargs in (dict(causal=True, window_size=(-1, 0)), dict(window_size=(-1, 0))):
        out = triflash.flash_attn_func(q, k, v, **kwargs)
        assert torch.equal(out, causal)
        for g, g2 in zip(grads, torch.autograd.grad(out, (q, k, v), dout)):
            assert torch.equal(g, g2)


def test_window_in_the_seeds_layout(device):
    q, k, v = make_qkv(2, 64, 80, 4, 2, 32, torch.float16, device)
    out = triflash.flash_attn_func(q, k, v, causal=True, window_size=(20, 0))
    out_bhsd = triflash.attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, window_size=(20, 0))
    assert torch.equal(out_bhsd, out.transpose(1, 2))


def test_window_on_packed_sequences(device):
    lengths = [(70, 70), (0, 5), (33, 90), (5, 1)]
    lq, lk = zip(*lengths)
    cu = [torch.tensor([0] + torch.tensor(x).cumsum(0).tolist(), dtype=torch.int32, device=device) for x in (lq, lk)]
    q = torch.randn(sum(lq), 4, 32, dtype=torch.float16, device=device, requires_grad=True)
    k = torch.randn(sum(lk), 2, 32, dtype=torch.float16, device=device, requires_grad=True)
    v = torch.randn(sum(lk), 2, 32, dtype=torch.float16, device=device, requires_grad=True)
    out = triflash.flash_attn_varlen_func(q, k, v, *cu, max(lq), max(lk), causal=True, window_size=(12, 0))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(lengths)):
        rows, keys = slice(cu[0][b], cu[0][b + 1]), slice(cu[1][b], cu[1][b + 1])
        if lq[b] == 0 or lk[b] == 0:
            continue
        dense = triflash.flash_attn_func(q[None, rows], k[None, keys], v[None, keys], causal=True,
                                         window_size=(12, 0))
        if not ON_GPU:
            assert torch.equal(out[rows], dense[0])            # the same kernel and tiles
        assert_grads_3x((grads[0][None, rows], grads[1][None, keys], grads[2][None, keys]), q[None, rows],
                        k[None, keys], v[None, keys], dout[None, rows], True, torch.float16, window_size=(12, 0))


@pytest.mark.skipif(not ON_GPU, reason="the interpreter runs a grid's programs one after another: only a "
                                         "GPU can tell")
def test_window_backward_is_deterministic(device):
    q, k, v = make_qkv(2, 1024, 1024, 6, 2, 64, torch.float16, device, requires_grad=True)
    assert_20_backward_passes_equal(triflash.flash_attn_func(q, k, v, causal=True, window_size=(256, 0)), (q, k, v))


def test_huge_windows_are_unbounded(device):
    """Bounds far past the sequences (here near int32's limit, where the kernels' sums of bounds and
    positions would wrap) behave as unbounded: the same bits as the window cut to the lengths."""
    q, k, v = make_qkv(1, 30, 50, 2, 1, 32, torch.float16, device)
    for huge, cut in (((2**31 - 1, -1), (80, -1)), ((-1, 2**31 - 1), (-1, 80)), ((2**31 - 2, 2**31 - 2), (80, 80))):
        out, lse = triflash.flash_attn_func(q, k, v, window_size=huge, return_lse=True)
        assert torch.equal(out, triflash.flash_attn_func(q, k, v, window_size=cut))
        assert_matches_reference(out, lse, q, k, v)                  # every key, as with no window
    assert torch.equal(triflash.flash_attn_func(q, k, v, causal=True, window_size=(2**31 - 1, 0)),
                       triflash.flash_attn_func(q, k, v, causal=True))


def test_a_gluon_variant_given_with_a_window_is_not_taken(device):
    """backward(..., variant=variant) with a window runs the Triton kernels (the Gluon ones have no
    windows): the same bits as without the variant."""
    from triflash.kernels.dispatch import backward, forward

    q, k, v = make_qkv(1, 40, 40, 2, 1, 64, torch.float16, device)
    out, lse = forward(q, k, v, 0.125, True, window=(8, 0))
    dout = torch.randn_like(out)
    plain = backward(dout, q, k, v, out, lse, 0.125, True, window=(8, 0))
    forced = backward(dout, q, k, v, out, lse, 0.125, True, window=(8, 0), variant="dkdv")
    for a, b in zip(plain, forced):
        assert torch.equal(a, b)


def test_window_size_is_checked(device):
    q, k, v = make_qkv(1, 8, 8, 2, 1, 16, torch.float16, device)
    f = triflash.flash_attn_func
    assert_raises_naming(TypeError, ["window_size", "pair of ints", "8"], f, q, k, v, window_size=8)
    assert_raises_naming(TypeError, ["window_size", "pair of ints"], f, q, k, v, window_size=(1.0, 2))
    assert_raises_naming(ValueError, ["window_size", ">= -1", "-2"], f, q, k, v, window_size=(-2, 0))
    assert_raises_naming(ValueError, ["window_size[1]", "causal=True", "3"], f, q, k, v, causal=True,
                         window_size=(4, 3))
