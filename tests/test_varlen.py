"""flash_attn_varlen_func: packed sequences of different lengths, forward and backward.

Each sequence of the packed batch is checked against the float64 reference run on that sequence
alone, by the suites' rules (helpers.py): the forward's 2x rule for out and lse, the backward's 3x
rule for dQ, dK and dV. The lengths cover an empty sequence (no queries), a sequence with no keys,
one-row sequences, tails that are no multiple of a block, and causal with more queries than keys
(rows that see no key) and fewer.
"""

import pytest
import torch
from conftest import DTYPES, ON_GPU
from helpers import (
    DTYPE_ID,
    assert_20_backward_passes_equal,
    assert_matches_reference,
    assert_no_nan,
    assert_packed_grads_3x,
    assert_packed_matches_reference,
    assert_raises_naming,
    cu_seqlens,
    packed_sequences,
    sequence_slices,
)

import triflash
from triflash import api
from triflash.kernels import dispatch
from triflash.kernels.common import Varlen

# (queries, keys) per sequence.
LENGTHS = [(17, 17), (0, 9), (130, 100), (1, 1), (5, 0), (40, 71), (64, 64)]
HEADS = [(4, 4), (4, 2), (4, 1)]
HEADS_ID = {(4, 4): "mha", (4, 2): "gqa2", (4, 1): "mqa"}


def _cases():
    dtypes = DTYPES
    cases = []
    for i, (causal, heads) in enumerate((c, h) for c in (False, True) for h in HEADS):
        head_dim = (64, 40, 128)[i % 3] if ON_GPU else (32, 40)[i % 2]
        for dtype in (dtypes if ON_GPU else [dtypes[i % len(dtypes)]]):
            cases.append(pytest.param(causal, heads, head_dim, dtype,
                                      id=f"{'causal' if causal else 'full'}-{HEADS_ID[heads]}-D{head_dim}-"
                                         f"{DTYPE_ID[dtype]}"))
    return cases


@pytest.mark.parametrize("causal,heads,head_dim,dtype", _cases())
def test_varlen_forward_matches_each_sequence(device, causal, heads, head_dim, dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences(LENGTHS, heads, head_dim, dtype, device)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                               return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (heads[0], q.shape[0]) and lse.dtype == torch.float32
    assert_packed_matches_reference(out, lse, q, k, v, cu_q, cu_k, causal)


@pytest.mark.parametrize("causal,heads,head_dim,dtype", _cases())
def test_varlen_backward_matches_each_sequence(device, causal, heads, head_dim, dtype):
    """Gradients through out and lse (a loss on both), each sequence against its own reference; the
    keys of a sequence with no queries and the queries of one with no keys get zero gradients."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences(LENGTHS, heads, head_dim, dtype, device, requires_grad=True)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                               return_lse=True)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse)
    # A row that sees no key has lse = -inf; its dlse has nothing to act on (its p are all 0).
    torch.autograd.backward((out, lse), (dout, dlse))
    assert_packed_grads_3x((q.grad, k.grad, v.grad), q, k, v, dout, cu_q, cu_k, causal, dtype, dlse)


def test_varlen_reads_strided_inputs_in_place(device):
    """q, k, v unbound from a packed [total, 3, H, D] tensor and a dout sliced out of a wider tensor
    (row stride 4 x 96, read in place) give the same bits as contiguous copies."""
    cu = cu_seqlens([33, 7, 64], device)
    qkv = torch.randn(104, 3, 4, 32, dtype=torch.float16, device=device, requires_grad=True)
    q, k, v = qkv.unbind(1)
    out = triflash.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, causal=True)
    dout = torch.randn(104, 4, 96, dtype=torch.float16, device=device)[..., 16:48]
    assert dout.stride() == (384, 96, 1)
    (dq, dk, dv) = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    out2 = triflash.flash_attn_varlen_func(*leaves, cu, cu, 64, 64, causal=True)
    grads2 = torch.autograd.grad(out2, leaves, dout.contiguous())
    assert torch.equal(out, out2)
    for g, g2 in zip((dq, dk, dv), grads2):
        assert torch.equal(g, g2)


def test_varlen_one_sequence_matches_flash_attn_func(device):
    """One sequence packed is a batch of one: the same result as flash_attn_func on it (by the 2x rule:
    on the GPU the dense call may take another kernel)."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences([(77, 90)], (4, 2), 64, torch.float16, device)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                               return_lse=True)
    dense, dense_lse = triflash.flash_attn_func(q[None], k[None], v[None], causal=True, return_lse=True)
    if not ON_GPU:
        # The interpreter runs the same Triton kernel on the same tiles: the same bits.
        assert torch.equal(out, dense[0]) and torch.equal(lse, dense_lse[0])
    assert_matches_reference(out[None], lse[None], q[None], k[None], v[None], causal=True)


def test_varlen_max_seqlen_may_exceed_the_longest(device):
    """max_seqlen_* only size the launch: larger values give the same bits."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences([(20, 30), (9, 4)], (2, 2), 32, torch.float16, device)
    out = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    wide = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q + 200, max_k + 300)
    assert torch.equal(out, wide)


def test_varlen_all_sequences_empty(device):
    """No rows at all, and rows with no keys at all: shapes kept, zeros and -inf, zero gradients."""
    q, k, v, cu_q, cu_k, _, _ = packed_sequences([(0, 3), (0, 0)], (2, 1), 16, torch.float16, device,
                                                  requires_grad=True)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 0, 3, return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))
    q, k, v, cu_q, cu_k, _, _ = packed_sequences([(3, 0), (2, 0)], (2, 1), 16, torch.float16, device,
                                                  requires_grad=True)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 0, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.all(lse == float("-inf"))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    assert_no_nan("dq", q.grad)


def test_varlen_max_seqlen_is_cut_to_the_packed_length(device):
    """A bound far past any sequence (here 2^40, whose grid would pass CUDA's limit) is cut to the
    packed total: the same bits as the exact bound."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences([(20, 30), (9, 4)], (2, 2), 32, torch.float16, device)
    out = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    huge = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2**40, 2**40)
    assert torch.equal(out, huge)


@pytest.mark.skipif(not ON_GPU, reason="the interpreter runs a grid's programs one after another: only a "
                                         "GPU can tell")
def test_varlen_backward_is_deterministic(device):
    q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences([(1000, 1000), (3, 500), (700, 20)], (6, 2), 64,
                                                torch.float16, device, requires_grad=True)
    out = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    assert_20_backward_passes_equal(out, (q, k, v))


def _poison(t, rows):
    """NaN in these rows of a packed tensor (a copy)."""
    t = t.detach().clone()
    t[rows] = float("nan")
    return t


def test_varlen_nan_stays_in_its_sequence(device):
    """A NaN in one sequence's queries, keys and values reaches no other sequence: a kernel that reads
    a neighbour's rows (a tile running past its sequence's end) must mask them, and for V zero them
    (0 * NaN is NaN)."""
    lengths = [(130, 100), (40, 71), (64, 64), (3, 129)]
    q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences(lengths, (4, 2), 64, torch.float16, device)
    (rq, rk), = sequence_slices(cu_q, cu_k)[1:2]
    q, k, v = _poison(q, rq), _poison(k, rk), _poison(v, rk)
    for causal in (False, True):
        out, lse = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                                   return_lse=True)
        assert_packed_matches_reference(out, lse, q, k, v, cu_q, cu_k, causal, skip=(1,))


def test_which_forward_takes_packed_sequences(device, monkeypatch):
    """The dispatch of packed sequences, with the Hopper kernel stubbed in (any machine): the chooser's
    pick at the longest lengths while dispatch.GLUON_PACKED is on (head dim 128: ``pp``; 64, causal
    below 2k queries: the Triton kernel, as dense; never an _ltc form), the Triton kernel with it off
    unless a Gluon variant is forced; an explicit config keeps Triton."""
    from triflash.kernels import configs, forward_hopper, sm90_common
    from triflash.kernels.configs import FwdConfig

    taken = []

    def stub(q, k, v, sm_scale, causal, out=None, *, variant, scores, window, varlen):
        assert q.dim() == 3 and varlen is not None and varlen.max_seqlen_q == max_q
        taken.append(variant)
        return out, torch.zeros(q.shape[1], q.shape[0], device=q.device)

    monkeypatch.setattr(configs, "gluon_hopper_applies", lambda *, head_dim, dtype, device: head_dim in (64, 128))
    monkeypatch.setattr(sm90_common, "tma_supported", lambda *tensors: all(t.dim() == 4 for t in tensors))
    monkeypatch.setattr(forward_hopper, "forward_hopper", stub)
    for head_dim, expected in ((64, []), (128, ["pp"])):
        q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences([(20, 20), (35, 35)], (2, 1), head_dim, torch.float16,
                                                             device)
        vl = Varlen(cu_q, cu_k, max_q, max_k)
        taken.clear()
        dispatch.forward(q, k, v, 0.125, True, varlen=vl)
        assert taken == expected
    taken.clear()
    dispatch.forward(q, k, v, 0.125, True, varlen=vl, window=(16, 0))
    assert taken == ["pp_persist"]         # head dim 128 with a window: as dense
    taken.clear()
    monkeypatch.setattr(dispatch, "GLUON_PACKED", False)
    dispatch.forward(q, k, v, 0.125, True, varlen=vl)
    assert taken == []
    dispatch.forward(q, k, v, 0.125, True, varlen=vl, variant="pp_persist")
    assert taken == ["pp_persist"]
    monkeypatch.setattr(dispatch, "GLUON_PACKED", True)
    taken.clear()
    dispatch.forward(q, k, v, 0.125, False, varlen=vl, config=FwdConfig(32, 32, 4, 1))
    assert taken == []


# On sm_90 at head dims 64 and 128 (fp16/bf16) the Gluon forward takes packed sequences when forced
# (dispatch.GLUON_PACKED): each variant the chooser can take for them, at lengths that cross the 128- and
# 192-row query tiles and the 128-key blocks, with an empty sequence, one without keys, Sq != Sk both
# ways; plain, with a window, with every score variant, and with NaN in one sequence.
HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
HOPPER_LENGTHS = [(300, 250), (0, 9), (17, 17), (200, 471), (5, 0), (700, 700), (129, 128), (1, 300)]


HOPPER_EXTRAS = ("plain", "gqa", "window", "scores", "nan")


def _hopper_cases(candidates):
    """(variant, causal, head_dim, dtype, extra) for each variant ``candidates(head_dim, dtype)`` names
    where the Gluon kernels run (an sm_90 GPU), else one skipped case."""
    from triflash.kernels import configs

    cases = []
    for head_dim, dtype in ((64, torch.float16), (64, torch.bfloat16), (128, torch.float16), (128, torch.bfloat16)):
        if not (HOPPER and configs.gluon_hopper_applies(head_dim=head_dim, dtype=dtype, device="cuda")):
            continue
        for variant in candidates(head_dim, dtype):
            for causal in (False, True):
                for extra in HOPPER_EXTRAS:
                    cases.append(pytest.param(variant, causal, head_dim, dtype, extra,
                                              id=f"{variant}-{'causal' if causal else 'full'}-D{head_dim}-"
                                                 f"{DTYPE_ID[dtype]}-{extra}"))
    return cases or [pytest.param(*[None] * 5, marks=pytest.mark.skip(reason="needs an sm_90 GPU (Gluon kernels)"))]


def _hopper_inputs(extra, causal, head_dim, dtype, device):
    """The Hopper packed cases' call: (q, k, v, cu_q, cu_k, max_q, max_k, window, score variants,
    sequences not checked, the poisoned query rows or None). "gqa": 8 query heads over 2; "window":
    a window; "scores": softcap, [B, Hq] ALiBi and sinks; "nan": NaN in sequence 3's q, k, v."""
    heads = (8, 2) if extra == "gqa" else (4, 4)
    q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences(HOPPER_LENGTHS, heads, head_dim, dtype, device)
    skip, poisoned = (), None
    if extra == "nan":
        (poisoned, rk), = sequence_slices(cu_q, cu_k)[3:4]
        q, k, v, skip = _poison(q, poisoned), _poison(k, rk), _poison(v, rk), (3,)
    window = ((64, 0) if causal else (100, 37)) if extra == "window" else (-1, -1)
    variants = {}
    if extra == "scores":
        variants = dict(softcap=5.0, alibi_slopes=torch.rand(len(HOPPER_LENGTHS), heads[0], device=device),
                        sinks=torch.randn(heads[0], device=device))
    return q, k, v, cu_q, cu_k, max_q, max_k, window, variants, skip, poisoned


def _taken(monkeypatch, module, name):
    """Record (variant, packed) of each call of ``module.name`` (the Gluon launcher), then run it."""
    taken = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name,
                        lambda *a, **kw: taken.append((kw["variant"], kw.get("varlen") is not None)) or real(*a, **kw))
    return taken


@pytest.mark.parametrize("variant,causal,head_dim,dtype,extra",
                         _hopper_cases(lambda d, dtype: dispatch.forward_candidates(d, dtype, packed=True)))
def test_hopper_forward_on_packed_sequences(device, force_kernels, monkeypatch, variant, causal, head_dim, dtype,
                                            extra):
    """Each Gluon forward variant, forced, on packed sequences: every sequence against its own reference
    (2x rule), and the forced kernel is the one that ran."""
    from triflash.kernels import forward_hopper

    taken = _taken(monkeypatch, forward_hopper, "forward_hopper")
    force_kernels(forward=variant)
    q, k, v, cu_q, cu_k, max_q, max_k, window, variants, skip, _ = _hopper_inputs(extra, causal, head_dim, dtype,
                                                                                   device)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window,
                                               return_lse=True, **variants)
    assert_packed_matches_reference(out, lse, q, k, v, cu_q, cu_k, causal, skip, window_size=window, **variants)
    assert taken == [(variant, True)]


def test_which_backward_takes_packed_sequences(device, monkeypatch):
    """The backward's dispatch of packed sequences, with the Gluon kernels stubbed in (any machine): the
    Triton kernels at head dims outside dispatch.GLUON_PACKED_BACKWARD, unless a dK/dV-only Gluon
    variant is forced (a fused one, which cannot take them, falls back); inside it, the chooser's pick
    at the longest lengths. The Gluon kernels get the packed
    rows' stats ([1, Hq, total_q rounded up to a multiple of 4], TMA's alignment) and ``varlen``;
    at head dim 64 dQ then comes from the Triton dQ kernel on those stats, bit-equal to the Triton
    path's dQ."""
    from triflash.kernels import backward_hopper, configs

    taken = []

    def stub_dkdv(dout, q, k, v, lse2, delta, sm_scale, causal, dq, dk, dv, *, variant, scores, window, varlen):
        assert q.dim() == 3 and varlen is vl and dq is None
        assert lse2.shape == delta.shape == (1, q.shape[1], backward_hopper.padded_rows(q.shape[0], packed=True))
        taken.append(("dkdv", variant))
        dk.zero_()
        dv.zero_()

    def stub_dq(dout, q, k, v, lse2, delta, sm_scale, causal, dq, *, variant, scores, window, varlen):
        assert varlen is vl and lse2.shape == (1, q.shape[1], backward_hopper.padded_rows(q.shape[0], packed=True))
        taken.append(("dq", variant))
        dq.zero_()

    monkeypatch.setattr(configs, "gluon_hopper_applies", lambda *, head_dim, dtype, device: head_dim in (64, 128))
    monkeypatch.setattr(dispatch, "SINGLE_MAX_WORK", -1)         # on a GPU these sizes take the single launch
    monkeypatch.setattr(backward_hopper, "supported", lambda q, k, v, dout, variant: q.dim() == 4)
    monkeypatch.setattr(backward_hopper, "backward_hopper", stub_dkdv)
    monkeypatch.setattr(backward_hopper, "dq_hopper", stub_dq)
    shipped = dispatch.GLUON_PACKED_BACKWARD
    for head_dim in (64, 128):
        q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences([(20, 24), (0, 5), (35, 30)], (2, 1), head_dim,
                                                             torch.float16, device)
        vl = Varlen(cu_q, cu_k, max_q, max_k)
        out, lse = dispatch.forward(q, k, v, 0.125, True, varlen=vl, variant="triton")
        dout = torch.randn_like(out)

        def backward(**kw):
            taken.clear()
            return dispatch.backward(dout, q, k, v, out, lse, 0.125, True, varlen=vl, **kw)

        # The Gluon kernels' launches: at head dim 64 dQ comes from the Triton dQ kernel.
        gluon = [("dkdv", "dkdv")] + ([("dq", "dkdv")] if head_dim == 128 else [])
        dq_triton, _, _ = backward(variant="triton")
        assert taken == []
        backward()                             # unforced: Gluon at the head dims GLUON_PACKED_BACKWARD names
        assert taken == (gluon if head_dim in shipped else [])
        monkeypatch.setattr(dispatch, "GLUON_PACKED_BACKWARD", frozenset())
        backward()
        assert taken == []
        backward(variant="split")              # fused: dQ in the same pass, no packed sequences
        assert taken == []
        dq, _, _ = backward(variant="dkdv")
        assert taken == gluon
        if head_dim == 64:                     # dQ from the Triton kernel on the Gluon path's stats
            assert torch.equal(dq, dq_triton)
        monkeypatch.setattr(dispatch, "GLUON_PACKED_BACKWARD", frozenset({64, 128}))
        backward()
        assert taken == gluon
        backward(config=configs.backward_config(head_dim=head_dim, dtype=q.dtype, device=q.device))
        assert taken == []
        monkeypatch.setattr(dispatch, "GLUON_PACKED_BACKWARD", shipped)


@pytest.mark.parametrize("variant,causal,head_dim,dtype,extra",
                         _hopper_cases(lambda d, dtype: dispatch.backward_candidates(d, one_pass=False)))
def test_hopper_backward_on_packed_sequences(device, force_kernels, monkeypatch, variant, causal, head_dim, dtype,
                                             extra):
    """Each Gluon backward variant the chooser takes, forced, on packed sequences
    (dispatch.GLUON_PACKED_BACKWARD): every sequence's gradients (through out and lse) against its own
    reference (3x rule), zeros for sequences without queries or keys, and the forced kernel is the
    one that ran. "nan": NaN in one sequence's q, k, v and dO reaches no other sequence's gradients
    (a tile past a sequence's end reads the next one's rows)."""
    from triflash.kernels import backward_hopper

    taken = _taken(monkeypatch, backward_hopper, "backward_hopper")
    force_kernels(backward=variant)
    q, k, v, cu_q, cu_k, max_q, max_k, window, variants, skip, poisoned = _hopper_inputs(extra, causal, head_dim,
                                                                                          dtype, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window,
                                               return_lse=True, **variants)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse)
    if poisoned is not None:
        dout = _poison(dout, poisoned)
    torch.autograd.backward((out, lse), (dout, dlse))
    assert_packed_grads_3x((q.grad, k.grad, v.grad), q, k, v, dout, cu_q, cu_k, causal, dtype, dlse, skip=skip,
                           window_size=window, **variants)
    assert taken == [(variant, True)]


# -- bad input ----------------------------------------------------------------------------------------

def _good(device):
    return packed_sequences([(5, 6), (3, 2)], (2, 1), 16, torch.float16, device)


def test_varlen_rejects_bad_offsets(device, monkeypatch):
    """Bad offsets raise; those that only their values reveal need the opt-in host check."""
    monkeypatch.setattr(api, "CHECK_CU_SEQLENS", True)
    q, k, v, cu_q, cu_k, max_q, max_k = _good(device)
    f = triflash.flash_attn_varlen_func
    assert_raises_naming(TypeError, ["cu_seqlens_q.dtype", "torch.int32", "torch.int64"],
                         f, q, k, v, cu_q.long(), cu_k, max_q, max_k)
    assert_raises_naming(ValueError, ["cu_seqlens_k", "1-D", "2-D"], f, q, k, v, cu_q, cu_k[None], max_q, max_k)
    assert_raises_naming(ValueError, ["cu_seqlens_k", "as many entries", "3", "2"],
                         f, q, k, v, cu_q, cu_k[:2], max_q, max_k)
    bad = cu_q.clone()
    bad[0] = 1
    assert_raises_naming(ValueError, ["cu_seqlens_q[0]", "must be 0", "got 1"], f, q, k, v, bad, cu_k, max_q, max_k)
    bad = torch.tensor([0, 6, 2], dtype=torch.int32, device=device)
    assert_raises_naming(ValueError, ["cu_seqlens_k", "non-decreasing", "6", "2"],
                         f, q, k, v, cu_q, bad, max_q, max_k)
    # A difference that wraps in int32 (-2^31 - (2^31 - 1) reads as +1 there) is still a decrease.
    bad = torch.tensor([0, 2**31 - 1, -2**31], dtype=torch.int32, device=device)
    assert_raises_naming(ValueError, ["cu_seqlens_q", "non-decreasing", "2147483647", "-2147483648"],
                         f, q, k, v, bad, cu_k, 2**31 - 1, max_k)
    bad = torch.tensor([0, 5, 7], dtype=torch.int32, device=device)
    assert_raises_naming(ValueError, ["cu_seqlens_q[-1]", "8 rows", "got 7"], f, q, k, v, bad, cu_k, max_q, max_k)
    assert_raises_naming(ValueError, ["max_seqlen_q", "length 5", "got max_seqlen_q = 4"],
                         f, q, k, v, cu_q, cu_k, 4, max_k)
    assert_raises_naming(TypeError, ["max_seqlen_k", "int", "float"], f, q, k, v, cu_q, cu_k, max_q, 6.0)
    assert_raises_naming(ValueError, ["max_seqlen_k", ">= 0", "-1"], f, q, k, v, cu_q, cu_k, max_q, -1)
    bad = torch.tensor([0, 6, 7], dtype=torch.int32, device=device)          # a sequence of 6 keys
    assert_raises_naming(ValueError, ["max_seqlen_k", "sequence 0 of length 6", "got max_seqlen_k = 5"],
                         f, q, k[:7], v[:7], cu_q, bad, max_q, 5)


def test_varlen_options_are_keyword_only(device):
    """FlashAttention 2 has dropout_p in the eighth place: a ported positional call raises instead of
    taking it for the scale."""
    q, k, v, cu_q, cu_k, max_q, max_k = _good(device)
    with pytest.raises(TypeError, match="positional"):
        triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, 0.1)
    assert_raises_naming(TypeError, ["return_lse", "bool", "int"], triflash.flash_attn_varlen_func,
                         q, k, v, cu_q, cu_k, max_q, max_k, return_lse=1)


def test_varlen_torch_func_transforms_raise(device):
    q, k, v, cu_q, cu_k, max_q, max_k = _good(device)
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.func.grad(lambda q: triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k).sum())(q)


def test_varlen_rejects_bad_tensors(device):
    q, k, v, cu_q, cu_k, max_q, max_k = _good(device)
    f = triflash.flash_attn_varlen_func
    assert_raises_naming(ValueError, ["q must", "3-D", "[total_q, heads_q, head_dim]", "4-D"],
                         f, q[None], k, v, cu_q, cu_k, max_q, max_k)
    assert_raises_naming(ValueError, ["v must", "same shape as k"], f, q, k, v[:, :, :8], cu_q, cu_k, max_q, max_k)
    assert_raises_naming(TypeError, ["k.dtype", "float16", "float32"], f, q, k.float(), v, cu_q, cu_k, max_q, max_k)
    assert_raises_naming(ValueError, ["multiple", "Hq=2", "Hkv=3"],
                         f, q, k.expand(-1, 3, -1), v.expand(-1, 3, -1), cu_q, cu_k, max_q, max_k)


def test_varlen_offsets_check_is_opt_in(device, monkeypatch):
    """By default the offsets' values are not read (no host sync, as in FlashAttention; the shapes
    are still checked); CHECK_CU_SEQLENS = True reads them on every call."""
    q, k, v, cu_q, cu_k, max_q, max_k = _good(device)
    reads = []
    real_check = api._check_cu_seqlens
    monkeypatch.setattr(api, "_check_cu_seqlens", lambda *a: reads.append(1) or real_check(*a))
    assert api.CHECK_CU_SEQLENS is False
    out = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    assert not reads and out.shape == q.shape
    assert_raises_naming(ValueError, ["cu_seqlens_k", "as many entries"], triflash.flash_attn_varlen_func,
                         q, k, v, cu_q, cu_k[:2], max_q, max_k)
    monkeypatch.setattr(api, "CHECK_CU_SEQLENS", True)
    checked = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    assert reads and torch.equal(checked, out)


# -- torch.compile and the ops' registrations -----------------------------------------------------------

BACKEND = "inductor" if ON_GPU else "aot_eager"


def test_varlen_compiles_without_graph_breaks(device):
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences([(20, 20), (9, 9), (33, 33)], (4, 2), 32, torch.float32,
                                                device, requires_grad=True)

    def step(q, k, v):
        return (triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True) ** 2).mean()

    compiled = torch.compile(step, backend=BACKEND, fullgraph=True)    # fullgraph: a break would raise
    loss_c = compiled(q, k, v)
    grads_c = torch.autograd.grad(loss_c, (q, k, v))
    loss_e = step(q, k, v)
    grads_e = torch.autograd.grad(loss_e, (q, k, v))
    if not ON_GPU:
        # aot_eager runs the same eager kernels in the same order: bit-identical.
        assert torch.equal(loss_c, loss_e)
        assert all(torch.equal(gc, ge) for gc, ge in zip(grads_c, grads_e))
    else:
        # Inductor generates its own fp32 kernels for the square and the mean (other summation
        # orders); triflash's ops are the same calls in both: a few fp32 ulps (as test_compile.py).
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
        for gc, ge in zip(grads_c, grads_e):
            torch.testing.assert_close(gc, ge, rtol=1e-4, atol=1e-6)


def test_varlen_opcheck(device):
    import triflash.autograd  # noqa: F401  (registers torch.ops.triflash.*)

    q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences([(20, 24), (3, 0), (9, 5)], (2, 1), 32, torch.float16, device,
                                                requires_grad=True)
    torch.library.opcheck(torch.ops.triflash.varlen_fwd.default, (q, k, v, cu_q, cu_k, max_q, max_k, 0.2, True))
    out, lse = torch.ops.triflash.varlen_fwd(q.detach(), k.detach(), v.detach(), cu_q, cu_k, max_q, max_k, 0.2,
                                             True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    for dl, need_dq, need_dkdv in ((None, True, True), (dlse, True, True), (dlse, False, True), (None, True, False)):
        torch.library.opcheck(torch.ops.triflash.varlen_bwd.default,
                              (dout, q.detach(), k.detach(), v.detach(), out, lse, dl, cu_q, cu_k, max_q, max_k,
                               0.2, True, need_dq, need_dkdv))
