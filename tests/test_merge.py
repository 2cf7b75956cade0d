"""merge_attn_states: combining partial (out, lse) states, on its own.

Random partials against a float64 log-sum-exp reference (the 2x rule of helpers.py, the baseline being
the same merge written in PyTorch in the partials' dtype with float32 softmax weights), empty parts
and empty rows, list input, strided input, validation, and the round trip: attention over key
chunks merged back equals attention over all keys.
"""

import pytest
import torch
from conftest import DTYPES, ON_GPU
from helpers import DTYPE_ID, FLOOR, LSE_FLOOR, assert_2x_rule, assert_no_nan, assert_raises_naming

import triflash
import triflash.kvcache as kvcache
from triflash.kvcache import merge_attn_states
from triflash.reference import flash_attn_ref, merge_attn_states_ref


def merge_same_dtype(out_partials, lse_partials):
    """The merge as PyTorch would do it at working precision: float32 weights, result in the
    partials' dtype (the 2x rule's baseline)."""
    lse = torch.logsumexp(lse_partials.float(), dim=0)
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    w = torch.exp(lse_partials.float() - safe).permute(0, 1, 3, 2)[..., None]
    parts = torch.where(w > 0, out_partials.float(), 0.0)
    return (w * parts).sum(0).to(out_partials.dtype), lse


def random_partials(n, batch, seqlen, heads, head_dim, dtype, device, empty_parts=(), empty_rows=0):
    """Partials whose LSEs spread over a few units (so every part matters), some parts entirely
    empty (lse = -inf, out = NaN garbage that must never be read), and ``empty_rows`` (b, h, s) rows
    where every part is empty."""
    out = torch.randn(n, batch, seqlen, heads, head_dim, device=device).to(dtype)
    lse = (torch.randn(n, batch, heads, seqlen, device=device) * 3 + 5).float()
    for p in empty_parts:
        lse[p] = float("-inf")
        out[p] = float("nan")
    for _ in range(empty_rows):
        b, h, s = (int(torch.randint(0, x, ())) for x in (batch, heads, seqlen))
        lse[:, b, h, s] = float("-inf")
        out[:, b, s, h] = float("nan")
    return out, lse


def check_merge(out, lse, out_partials, lse_partials, dtype):
    n, batch, seqlen, heads, head_dim = out_partials.shape
    assert out.shape == (batch, seqlen, heads, head_dim) and out.dtype == dtype
    assert lse.shape == (batch, heads, seqlen) and lse.dtype == torch.float32
    ref, ref_lse = merge_attn_states_ref(out_partials, lse_partials)
    same, same_lse = merge_same_dtype(out_partials, lse_partials)
    assert_no_nan("lse", lse)
    assert_2x_rule("out", out, ref, same, dtype)
    assert_2x_rule("lse", lse, ref_lse, same_lse, dtype, LSE_FLOOR, relative_floor=True)
    empty = torch.isneginf(ref_lse).permute(0, 2, 1)                       # [B, S, H]
    assert torch.equal(out[empty], torch.zeros_like(out[empty])), "rows with no key must be 0"


CASES = [
    pytest.param(1, (), 0, id="N1"),
    pytest.param(2, (), 0, id="N2"),
    pytest.param(5, (), 0, id="N5"),
    pytest.param(5, (1, 3), 0, id="N5-two-empty-parts"),
    pytest.param(2, (1,), 3, id="N2-one-empty-part-empty-rows"),
    pytest.param(5, (0,), 4, id="N5-first-empty-empty-rows"),
    pytest.param(1, (0,), 0, id="N1-all-empty"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=[DTYPE_ID[d] for d in DTYPES])
@pytest.mark.parametrize("head_dim", [40, 128], ids=["D40", "D128"])
@pytest.mark.parametrize("n,empty_parts,empty_rows", CASES)
def test_merge_matches_reference(device, dtype, head_dim, n, empty_parts, empty_rows):
    batch, seqlen, heads = (3, 5, 4) if not ON_GPU else (4, 33, 16)
    out_p, lse_p = random_partials(n, batch, seqlen, heads, head_dim, dtype, device, empty_parts,
                                   empty_rows)
    out, lse = merge_attn_states(out_p, lse_p)
    check_merge(out, lse, out_p, lse_p, dtype)


@pytest.mark.parametrize("head_dim", [128, 16], ids=["D128", "D16"])
def test_many_parts(device, head_dim):
    """More parts than one tile holds (split-KV decode of a long sequence at batch 1): the parts are
    taken in several steps; empty parts in several steps. One early part dominates by far more than
    exp() can hold in fp32 (the max must be taken over every step before any weight is formed)."""
    n = 150
    out_p, lse_p = random_partials(n, 1, 1, 8, head_dim, torch.float32, device,
                                   empty_parts=(0, 5, 77, 149), empty_rows=1)
    lse_p[3] += 200.0
    out, lse = merge_attn_states(out_p, lse_p)
    check_merge(out, lse, out_p, lse_p, torch.float32)


def test_merge_single_part_is_identity(device):
    out_p, lse_p = random_partials(1, 2, 3, 4, 64, torch.float32, device)
    out, lse = merge_attn_states(out_p, lse_p)
    assert torch.equal(lse, lse_p[0])
    torch.testing.assert_close(out, out_p[0], rtol=2**-22, atol=0)


def test_all_rows_empty(device):
    """Every part of every row empty: out 0, lse -inf, no NaN (the NaN-filled outs are never read)."""
    out_p, lse_p = random_partials(3, 2, 3, 2, 16, torch.float16, device, empty_parts=(0, 1, 2))
    out, lse = merge_attn_states(out_p, lse_p)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


def test_list_input(device):
    """Lists (and tuples) of per-part tensors are stacked: same answer as the stacked tensors."""
    out_p, lse_p = random_partials(3, 2, 7, 3, 48, torch.float16, device, empty_parts=(2,))
    out, lse = merge_attn_states(list(out_p), list(lse_p))
    out2, lse2 = merge_attn_states(out_p, lse_p)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    out3, lse3 = merge_attn_states(tuple(out_p), tuple(lse_p))
    assert torch.equal(out, out3) and torch.equal(lse, lse3)
    check_merge(out, lse, out_p, lse_p, torch.float16)


def test_strided_input(device):
    """Partials that are views (a [N, B, H, S, D] buffer seen as [N, B, S, H, D]; lse a slice) are
    read in place through their strides."""
    dtype = torch.float32
    buf = torch.randn(4, 2, 3, 5, 24, device=device, dtype=dtype)             # [N, B, H, S, D]
    out_p = buf.transpose(2, 3)                                               # [N, B, S, H, D]
    lse_buf = torch.randn(4, 2, 3, 10, device=device) * 2
    lse_p = lse_buf[..., ::2]                                                 # [N, B, H, S], strided
    out, lse = merge_attn_states(out_p, lse_p)
    check_merge(out, lse, out_p.contiguous(), lse_p.contiguous(), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=[DTYPE_ID[d] for d in DTYPES])
def test_merge_of_key_chunks_is_full_attention(device, dtype):
    """flash_attn_func over disjoint key chunks (one of them empty), merged, equals attention over
    all keys: the state-merging identity the split-KV decode relies on."""
    q = torch.randn(2, 9, 4, 64, dtype=dtype, device=device)
    k = torch.randn(2, 70, 2, 64, dtype=dtype, device=device)
    v = torch.randn(2, 70, 2, 64, dtype=dtype, device=device)
    bounds = [0, 23, 23, 64, 70]                                              # chunk 23:23 is empty
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        o, lse = triflash.flash_attn_func(q, k[:, lo:hi], v[:, lo:hi], return_lse=True)
        outs.append(o)
        lses.append(lse)
    out, lse = merge_attn_states(outs, lses)
    ref, ref_lse = flash_attn_ref(q, k, v, return_lse=True)
    same, same_lse = flash_attn_ref(q, k, v, compute_dtype=None, return_lse=True)
    # Each chunk's output was rounded to the dtype once before the merge: allow for that rounding.
    assert_2x_rule("out", out, ref, same, dtype, {dtype: 2 * FLOOR[dtype] + torch.finfo(dtype).eps})
    assert_2x_rule("lse", lse, ref_lse, same_lse, dtype, LSE_FLOOR, relative_floor=True)


def test_empty_shapes(device):
    out_p = torch.randn(2, 0, 3, 4, 16, device=device)
    lse_p = torch.randn(2, 0, 4, 3, device=device)
    out, lse = merge_attn_states(out_p, lse_p)
    assert out.shape == (0, 3, 4, 16) and lse.shape == (0, 4, 3)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def no_launch(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the merge kernel was launched before the bad input was rejected")
    monkeypatch.setattr(kvcache.dispatch, "merge", boom)


def _bad_inputs(device):
    out_p = torch.randn(3, 2, 5, 4, 16, device=device)
    lse_p = torch.randn(3, 2, 4, 5, device=device)
    return [
        ("out-rank", (out_p[0], lse_p), ValueError, ["out_partials", "5-D", "4-D"]),
        ("lse-rank", (out_p, lse_p[0]), ValueError, ["lse_partials", "4-D", "3-D"]),
        ("lse-dtype", (out_p, lse_p.double()), TypeError, ["lse_partials.dtype", "torch.float32",
                                                           "torch.float64"]),
        ("out-dtype", (out_p.double(), lse_p), TypeError, ["out_partials.dtype", "torch.float64"]),
        ("lse-shape", (out_p, lse_p.transpose(2, 3)), ValueError,
         ["lse_partials", "(3, 2, 4, 5)", "(3, 2, 5, 4)"]),
        ("n-mismatch", (out_p, lse_p[:2]), ValueError, ["lse_partials", "(3, 2, 4, 5)", "(2, 2, 4, 5)"]),
        ("no-parts", (out_p[:0], lse_p[:0]), ValueError, ["out_partials", "N >= 1", "N = 0"]),
        ("empty-list", ([], []), ValueError, ["out_partials", "at least one", "list"]),
        ("list-shapes", ([out_p[0], out_p[1, :, :3]], list(lse_p[:2])), ValueError,
         ["out_partials[1]", "(2, 5, 4, 16)", "(2, 3, 4, 16)"]),
        ("list-element-type", ([out_p[0], "x"], list(lse_p[:2])), TypeError,
         ["out_partials[1]", "torch.Tensor", "str"]),
        ("list-rank", (list(out_p[:, 0]), list(lse_p)), ValueError, ["out_partials[0]", "4-D", "3-D"]),
        ("not-a-tensor", (out_p.tolist(), lse_p), TypeError, ["out_partials[0]", "torch.Tensor"]),
        ("lse-not-a-tensor", (out_p, 1.0), TypeError, ["lse_partials", "torch.Tensor", "float"]),
    ]


BAD_IDS = [case[0] for case in _bad_inputs("cpu")]


@pytest.mark.parametrize("case_id", BAD_IDS)
def test_bad_input_raises_before_launch(device, no_launch, case_id):
    _, args, exc, words = next(c for c in _bad_inputs(device) if c[0] == case_id)
    assert_raises_naming(exc, words, merge_attn_states, *args)


def test_partials_on_other_devices(device, no_launch):
    out_p = torch.randn(2, 1, 3, 2, 16, device=device)
    lse_p = torch.randn(2, 1, 2, 3, device="meta")
    with pytest.raises(ValueError, match=r"lse_partials must be on the same device as out_partials"):
        merge_attn_states(out_p, lse_p)


@pytest.mark.parametrize("dtype", DTYPES, ids=[DTYPE_ID[d] for d in DTYPES])
@pytest.mark.parametrize("n,empty_parts,empty_rows", [CASES[1], CASES[3], CASES[4]])
def test_merge_gradients(device, dtype, n, empty_parts, empty_rows):
    """Gradients of out and lse with respect to both inputs, against autograd through the float64
    reference by the 2x rule (baseline: the same formulas in float32). Empty parts and rows (whose
    partial outputs are NaN garbage) get zero gradients, never NaN; the references' logsumexp gives
    NaN on an all-empty row, so those rows are compared with zero instead."""
    out_p, lse_p = random_partials(n, 2, 5, 3, 40, dtype, device, empty_parts, empty_rows)
    out_p.requires_grad_()
    lse_p.requires_grad_()
    out, lse = merge_attn_states(out_p, lse_p)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (out_p, lse_p), (dout, dlse))

    def reference(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_() for t in (out_p, lse_p)]
        o, lse = fn(*leaves)
        return torch.autograd.grad((o, lse), leaves, (dout.to(o.dtype), dlse.to(lse.dtype)))
    ref = reference(merge_attn_states_ref, torch.float64)
    same = reference(merge_same_dtype, torch.float32)
    empty = torch.isneginf(torch.logsumexp(lse_p.detach().double(), 0))          # [B, H, S]
    masks = (empty.permute(0, 2, 1)[None, ..., None], empty[None])              # out's, lse's layout
    for name, g, r, s, m in zip(("d_out_partials", "d_lse_partials"), grads, ref, same, masks):
        assert g.shape == r.shape and g.dtype == (dtype if name == "d_out_partials" else torch.float32)
        assert_no_nan(name, g)
        zero = torch.zeros((), dtype=g.dtype, device=device)
        assert torch.equal(torch.where(m, g, zero), torch.zeros_like(g)), f"{name}: empty rows"
        r, s = (torch.where(m, 0.0, t) for t in (r, s))
        assert_2x_rule(name, g.float(), r, s.to(g.dtype).float(), dtype,
                       relative_floor=True)


def test_merge_without_grad_skips_the_autograd_node(device):
    out_p, lse_p = random_partials(2, 1, 3, 2, 16, torch.float32, device)
    out_p.requires_grad_()
    with torch.no_grad():
        out, _ = merge_attn_states(out_p, lse_p)
    assert out.grad_fn is None and not out.requires_grad
    out, _ = merge_attn_states(out_p, lse_p)
    assert out.requires_grad
