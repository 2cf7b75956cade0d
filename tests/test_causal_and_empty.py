"""Causal alignment, rows that see no key, empty tensors, and numerically hard inputs."""

import pytest
import torch
from helpers import assert_2x_rule, assert_matches_reference, assert_no_nan, make_qkv

import triflash
from triflash.reference import causal_visible, flash_attn_ref, naive_attention


def test_bottom_right_alignment_by_hand(device):
    """Sq=3, Sk=5: query i sees keys 0..i+2. Checked against a float64 softmax written out by hand,
    by the 2x rule (PyTorch's fp32 attention as the yardstick)."""
    q, k, v = make_qkv(1, 3, 5, 1, 1, 16, torch.float32, device)
    out = triflash.flash_attn_func(q, k, v, causal=True)
    qd, kd, vd = q[0, :, 0].double(), k[0, :, 0].double(), v[0, :, 0].double()
    expected = torch.stack([torch.softmax(qd[i] @ kd[:i + 3].T / 4.0, 0) @ vd[:i + 3]   # keys 0 .. i+2
                            for i in range(3)])
    same = flash_attn_ref(q, k, v, causal=True, compute_dtype=None)
    assert_2x_rule("out", out[0, :, 0], expected, same[0, :, 0], torch.float32)
    assert causal_visible(3, 5).tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(239, 1), (100, 37), (70, 64), (5, 2)])
def test_rows_with_no_visible_key(device, seqlen_q, seqlen_k):
    """Causal with Sq > Sk: the first Sq - Sk rows see nothing and get out = 0, lse = -inf, no NaN."""
    dtype = torch.float16
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 64, dtype, device)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert_no_nan("out", out)
    assert_no_nan("lse", lse)
    n_empty = seqlen_q - seqlen_k
    assert torch.equal(out[:, :n_empty], torch.zeros_like(out[:, :n_empty]))
    assert torch.isneginf(lse[:, :, :n_empty]).all()
    assert torch.isfinite(lse[:, :, n_empty:]).all()
    assert_matches_reference(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_no_keys_at_all(device, causal):
    q = torch.randn(2, 9, 2, 32, dtype=torch.float16, device=device)
    k = torch.randn(2, 0, 2, 32, dtype=torch.float16, device=device)
    out, lse = triflash.flash_attn_func(q, k, k, causal=causal, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all() and lse.shape == (2, 2, 9)


@pytest.mark.parametrize("shape_q,shape_k", [((0, 5, 2, 32), (0, 5, 2, 32)), ((2, 0, 2, 32), (2, 7, 2, 32))])
def test_empty_outputs(device, shape_q, shape_k):
    q = torch.randn(*shape_q, dtype=torch.float16, device=device)
    k = torch.randn(*shape_k, dtype=torch.float16, device=device)
    out, lse = triflash.flash_attn_func(q, k, k, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (shape_q[0], shape_q[2], shape_q[1])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_the_seeds_naive_attention(device, causal):
    """On the seeds' own setting (square, [B, H, S, D], one K/V head per query head)."""
    q, k, v = (torch.randn(2, 3, 150, 64, dtype=torch.float16, device=device) for _ in range(3))
    out = triflash.attention(q, k, v, causal=causal)
    ref = flash_attn_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal).transpose(1, 2)
    naive = naive_attention(q, k, v, causal=causal)
    assert_2x_rule("out", out, ref, naive, torch.float16)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_scores_stay_finite(device, causal):
    """Scores in the hundreds: exp without the running max would overflow even in fp32."""
    q = torch.randn(1, 130, 2, 64, dtype=torch.float16, device=device) * 8
    k = torch.randn(1, 130, 2, 64, dtype=torch.float16, device=device) * 8
    v = torch.randn(1, 130, 2, 64, dtype=torch.float16, device=device)
    out, lse = triflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_matches_reference(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("shape_q, shape_kv", [((2, 5, 0, 16), (2, 5, 0, 16)),     # no heads at all
                                               ((0, 5, 2, 16), (0, 5, 2, 16)),     # no batch
                                               ((2, 0, 2, 16), (2, 4, 2, 16))],    # no queries
                         ids=["no-heads", "no-batch", "no-queries"])
def test_empty_shapes_give_empty_results_as_sdpa(device, shape_q, shape_kv):
    """Empty inputs give empty results (and gradients) of the right shapes, as SDPA does; heads_q = 0
    with heads_kv = 0 is such a case, not a GQA error."""
    q = torch.randn(shape_q, device=device, requires_grad=True)
    k, v = (torch.randn(shape_kv, device=device, requires_grad=True) for _ in range(2))
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == shape_q and lse.shape == (shape_q[0], shape_q[2], shape_q[1])
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(not g.any() for g in grads)
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(t.detach().transpose(1, 2) for t in (q, k, v)))
    assert triflash.attention(*(t.detach().transpose(1, 2) for t in (q, k, v))).shape == sdpa.shape
    with torch.no_grad():
        assert triflash.flash_attn_with_kvcache(q, k, v).shape == shape_q


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (5, 2)), (False, (-1, -1))])
def test_reference_row_span_is_a_slice_of_the_whole(causal, window):
    """flash_attn_ref(row_span=(start, total)) on rows [start, start + n) of a problem equals those rows
    of the whole problem's result (masks, windows, ALiBi distances, sinks, empty rows), and a span
    outside the problem is refused naming the argument."""
    q, k, v = (torch.randn(2, n, 2, 8, dtype=torch.float64) for n in (30, 20, 20))
    kw = dict(causal=causal, window_size=window, return_lse=True, alibi_slopes=torch.tensor([0.3, 0.1]),
              sinks=torch.tensor([0.5, -1.0], dtype=torch.float64))
    whole, whole_lse = flash_attn_ref(q, k, v, **kw)
    for start, stop in ((0, 7), (7, 19), (19, 30)):
        part, part_lse = flash_attn_ref(q[:, start:stop], k, v, row_span=(start, 30), **kw)
        torch.testing.assert_close(part, whole[:, start:stop], rtol=0, atol=1e-14)
        torch.testing.assert_close(part_lse, whole_lse[:, :, start:stop], rtol=0, atol=1e-14)
    assert causal_visible(30, 20, rows=(7, 19), window_size=window, causal=causal).equal(
        causal_visible(30, 20, window_size=window, causal=causal)[7:19])
    for bad in ((25, 30), (-1, 30), (0, 5)):
        with pytest.raises(ValueError, match="row_span"):
            flash_attn_ref(q[:, :7], k, v, row_span=bad)
