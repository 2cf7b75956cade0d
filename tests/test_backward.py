"""Backward: gradients on the forward's grid, determinism, empty rows, strided dO, GQA, LSE gradients.

Tolerance: each of dQ, dK, dV within 3x the error of PyTorch's own same-dtype attention backward
against a float64 reference, plus a floor. Gradients are sums over whole sequences, not O(1) like the
forward's output, so the floor is relative: helpers.FLOOR times the largest reference gradient entry.
(It matters where PyTorch is exact: with one key, dQ is exactly 0 in PyTorch's softmax backward, while
FlashAttention's dP - rowsum(dO * O) cancels to a few rounding errors of |dP|.)

On a GPU the whole (seqlens x head dims x causal x dtype x heads) grid runs. Under the CPU interpreter
every seqlen pair meets both causal flags, and head dim, dtype and head grouping rotate across them.
"""

import itertools

import pytest
import torch
from conftest import DTYPES, ON_GPU
from helpers import (
    DTYPE_ID,
    HEAD_DIMS,
    HEADS,
    HEADS_ID,
    SEQLENS,
    assert_20_backward_passes_equal,
    assert_grads_3x,
    assert_no_nan,
    assert_within,
    grad_bounds,
    make_qkv,
    record_calls,
)

import triflash
from triflash.kernels import dispatch


def _cases():
    cases = []
    if ON_GPU:
        grid = itertools.product(SEQLENS, HEAD_DIMS, [False, True], DTYPES, HEADS)
    else:
        grid = []
        for i, ((sq, sk), causal) in enumerate(itertools.product(SEQLENS, [False, True])):
            if sq * sk > 100_000 and not causal:
                # 1k x 1k takes the interpreter 1.5-2.5 minutes: the long accumulation is checked once
                # here (causal: the unmasked blocks and the diagonal); every case meets it on the GPU.
                continue
            grid.append(((sq, sk), HEAD_DIMS[i % len(HEAD_DIMS)], causal, DTYPES[(i // 2 + i) % len(DTYPES)],
                         HEADS[i % len(HEADS)]))
    for (sq, sk), d, causal, dtype, heads in grid:
        batch = 1 if sq * sk > 100_000 else 2
        cid = (f"B{batch}-Sq{sq}-Sk{sk}-D{d}-{'causal' if causal else 'full'}-"
               f"{DTYPE_ID[dtype]}-{HEADS_ID[heads]}")
        cases.append(pytest.param(batch, sq, sk, d, causal, dtype, heads, id=cid))
    return cases


def _inputs(batch, sq, sk, hq, hkv, d, dtype, device):
    return make_qkv(batch, sq, sk, hq, hkv, d, dtype, device, requires_grad=True)


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,head_dim,causal,dtype,heads", _cases())
def test_backward_matches_reference(device, batch, seqlen_q, seqlen_k, head_dim, causal, dtype, heads):
    q, k, v = _inputs(batch, seqlen_q, seqlen_k, heads[0], heads[1], head_dim, dtype, device)
    out = triflash.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert_grads_3x((q.grad, k.grad, v.grad), q, k, v, dout, causal, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_bhsd_layout(device, causal):
    """attention() on [B, H, S, D]: gradients come back in that layout and match flash_attn_func's."""
    q = torch.randn(2, 6, 77, 64, dtype=torch.float16, device=device, requires_grad=True)
    k = torch.randn(2, 2, 90, 64, dtype=torch.float16, device=device, requires_grad=True)
    v = torch.randn(2, 2, 90, 64, dtype=torch.float16, device=device, requires_grad=True)
    out = triflash.attention(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    q2, k2, v2 = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    triflash.flash_attn_func(q2, k2, v2, causal=causal).backward(dout.transpose(1, 2))
    for g, g2 in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        assert g.shape == g2.transpose(1, 2).shape
        assert torch.equal(g, g2.transpose(1, 2))


@pytest.mark.skipif(not ON_GPU, reason="the interpreter runs a grid's programs one after another, so "
                                         "even atomics would be deterministic there: only a GPU can tell")
def test_backward_is_deterministic(device):
    """No atomics: 20 backward passes on the same inputs give bit-identical gradients."""
    _assert_20_passes_equal(*_inputs(2, 1024, 1024, 6, 2, 64, torch.float16, device), causal=True)


def _assert_20_passes_equal(q, k, v, causal):
    assert_20_backward_passes_equal(triflash.flash_attn_func(q, k, v, causal=causal), (q, k, v))


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(100, 37), (239, 1), (33, 32)])
def test_rows_with_no_visible_key_get_zero_gradients(device, seqlen_q, seqlen_k):
    q, k, v = _inputs(2, seqlen_q, seqlen_k, 4, 2, 64, torch.float16, device)
    out = triflash.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    n_empty = seqlen_q - seqlen_k
    for name, g in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert_no_nan(name, g)
    assert torch.equal(q.grad[:, :n_empty], torch.zeros_like(q.grad[:, :n_empty]))
    assert_grads_3x((q.grad, k.grad, v.grad), q, k, v, dout, True, torch.float16)


@pytest.mark.parametrize("kind", ["transposed", "strided", "expanded"])
def test_non_contiguous_dout(device, kind):
    """dO that is a transposed view, a strided slice, or a broadcast: same gradients, bit for bit."""
    q, k, v = _inputs(2, 70, 70, 4, 4, 32, torch.float16, device)
    out = triflash.flash_attn_func(q, k, v, causal=True)
    if kind == "transposed":
        dout = torch.randn(2, 4, 70, 32, dtype=out.dtype, device=device).transpose(1, 2)
    elif kind == "strided":
        dout = torch.randn(2, 140, 4, 32, dtype=out.dtype, device=device)[:, ::2]
    else:
        dout = torch.randn(1, 1, 1, 32, dtype=out.dtype, device=device).expand_as(out)
    assert not dout.is_contiguous()
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    grads_c = torch.autograd.grad(out, (q, k, v), dout.contiguous())
    for a, b in zip(grads, grads_c):
        assert torch.equal(a, b)
    assert_grads_3x(grads, q, k, v, dout, True, torch.float16)


def test_packed_qkv_gradients(device):
    """q, k, v unbound from one packed tensor: the gradient lands in the packed tensor."""
    qkv = torch.randn(2, 50, 3, 4, 32, dtype=torch.float16, device=device, requires_grad=True)
    q, k, v = qkv.unbind(2)
    out = triflash.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert_grads_3x(qkv.grad.unbind(2), q, k, v, dout, True, torch.float16)


def test_only_requested_gradients(device, monkeypatch):
    """Gradients flow only to tensors that require them, and unneeded kernels are not launched."""
    import triflash.autograd as ag

    calls = []
    real = ag.dispatch.backward

    def spy(*args, **kwargs):
        calls.append((kwargs["need_dq"], kwargs["need_dkdv"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(ag.dispatch, "backward", spy)
    q = torch.randn(1, 40, 2, 32, dtype=torch.float16, device=device, requires_grad=True)
    k = torch.randn(1, 40, 2, 32, dtype=torch.float16, device=device)
    v = torch.randn(1, 40, 2, 32, dtype=torch.float16, device=device)
    triflash.flash_attn_func(q, k, v).sum().backward()
    assert q.grad is not None and k.grad is None and v.grad is None
    assert calls == [(True, False)]
    q.grad = None
    k.requires_grad_()
    out = triflash.flash_attn_func(q.detach(), k, v)
    out.sum().backward()
    assert k.grad is not None and calls[-1] == (False, True)
    # Nothing requires grad: no graph at all.
    out = triflash.flash_attn_func(q.detach(), k.detach(), v)
    assert out.grad_fn is None


def test_lse_gradient(device):
    """A loss on the returned lse back-propagates too (dlse folds into delta)."""
    q, k, v = _inputs(2, 60, 75, 4, 2, 32, torch.float16, device)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))
    assert_grads_3x(grads, q, k, v, dout, True, torch.float16, dlse=dlse)


def test_no_s_by_s_tensor_is_saved(device):
    """The forward saves q, k, v, out and lse only: nothing of size Sq x Sk."""
    q, k, v = _inputs(1, 64, 96, 2, 2, 32, torch.float16, device)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = triflash.flash_attn_func(q, k, v, causal=True)
    assert sorted(saved) == sorted([tuple(q.shape), tuple(k.shape), tuple(v.shape), tuple(out.shape),
                                    (1, 2, 64)])


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_tile_paths_agree(device, causal, tma, monkeypatch):
    """The launcher's explicit configs: pointer loads and host-built TMA descriptors (the Hopper path;
    the interpreter runs it too) for the walked tiles, on ragged lengths, a head dim below its block
    (40 in 64 lanes) and a GQA group, against the reference."""
    import triflash.kernels.backward as bwd
    from triflash.kernels.configs import BwdConfig
    from triflash.kernels.dispatch import forward

    q, k, v = make_qkv(2, 75, 101, 4, 2, 40, torch.float16, device)
    dout = torch.randn_like(q)
    scale = 40 ** -0.5
    out, lse = forward(q, k, v, scale, causal)
    built = []
    real_descriptors = bwd.host_descriptors

    def counting(rows, block_d, *tensors):
        built.extend(tensors)
        return real_descriptors(rows, block_d, *tensors)

    monkeypatch.setattr(bwd, "host_descriptors", counting)
    config = (BwdConfig(32, 64, 4, 2, tma), BwdConfig(64, 32, 4, 2, tma))
    grads = dispatch.backward(dout, q, k, v, out, lse, scale, causal, config=config)
    assert len(built) == (4 if tma else 0)        # Q, dO for dK/dV; K, V for dQ
    assert_grads_3x(grads, q, k, v, dout, causal, torch.float16)


# --------------------------------------------------------------------------------------------------
# The Gluon backward for Hopper (kernels/backward_hopper.py): on an sm_90 GPU, every variant the chooser
# can take runs the backward grid at the head dims it serves, forced, and so do the fused form
# (``split``, kept though no longer chosen; its dQ is accumulated across CTAs in a fixed order, which
# the determinism test checks with many key blocks) and the Triton kernels (None: the path of every
# other GPU and of inputs the Gluon kernels do not take, which the chooser no longer picks on sm_90).
# --------------------------------------------------------------------------------------------------

HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)


def _force_hopper_backward(monkeypatch, force_kernels, variant):
    """Make the backward take the Gluon ``variant`` (None: the Triton kernels). Returns a function
    that asserts, given the number of backward calls made, that each ran exactly the kernels the
    variant names (not a silent fallback): the Gluon dK/dV kernel (or the fused one), and the
    Gluon dQ kernel where the variant's configuration takes it."""
    from triflash.kernels import backward_hopper

    # (variant, q's head dim) of each launcher call; args are (dout, q, k, v, ...).
    launches = {name: record_calls(monkeypatch, backward_hopper, name,
                                   lambda args, kwargs: (kwargs.get("variant"), args[1].shape[-1]))
                for name in ("backward_hopper", "dq_hopper")}
    force_kernels(backward=variant or "triton")

    def check(calls):
        got = launches["backward_hopper"]
        assert len(got) == (0 if variant is None else calls), launches
        assert all(v == variant for v, _ in got)
        gluon_dq = [d for _, d in got if not backward_hopper.computes_dq(variant)
                    and backward_hopper.dq_on_gluon(variant, d)]
        assert launches["dq_hopper"] == [(variant, d) for d in gluon_dq], launches
    check.launches = launches
    return check


# Forced by the GPU tests besides the chooser's candidates: the fused forms it does not take (see
# above), and split_tma, which it takes only where deterministic=False (and which stays tested if not).
KEPT_VARIANTS = {64: ("split", "split_atomic", "split_tma", None), 128: (None,)}


def _tested(head_dim):
    return tuple(dict.fromkeys(dispatch.backward_candidates(head_dim) + KEPT_VARIANTS.get(head_dim, ())))


def _hopper_variants(head_dims=(64, 128), reproducible=False):
    """(variant, head_dim) for every variant the chooser can take, the kept fused forms and the Triton
    kernels (None), or none off sm_90; ``reproducible``: only those whose gradients are bit-identical
    from run to run (not the atomic dQ form, whose own test bounds the difference)."""
    if not HOPPER:
        return []
    from triflash.kernels import backward_hopper

    return [pytest.param(v, d, id=f"{v or 'triton'}-D{d}") for d in head_dims for v in _tested(d)
            if not (reproducible and v is not None and not backward_hopper.reproducible(v))]


def _hopper_cases():
    cases = []
    if not HOPPER:
        return cases
    for d in (64, 128):
        for variant in _tested(d):
            for (sq, sk), causal, dtype, heads in itertools.product(
                    SEQLENS + [(4096 + 13, 4096 + 13), (1500, 1000), (1000, 1500)], [False, True],
                    [torch.float16, torch.bfloat16], HEADS):
                batch = 1 if sq * sk > 100_000 else 2
                cid = (f"{variant or 'triton'}-B{batch}-Sq{sq}-Sk{sk}-D{d}-{'causal' if causal else 'full'}-"
                       f"{DTYPE_ID[dtype]}-{HEADS_ID[heads]}")
                cases.append(pytest.param(variant, batch, sq, sk, d, causal, dtype, heads, id=cid))
    return cases


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("variant,batch,seqlen_q,seqlen_k,head_dim,causal,dtype,heads", _hopper_cases())
def test_hopper_backward_matches_reference(force_kernels, device, monkeypatch, variant, batch, seqlen_q, seqlen_k,
                                           head_dim,
                                           causal, dtype, heads):
    check = _force_hopper_backward(monkeypatch, force_kernels, variant)
    q, k, v = _inputs(batch, seqlen_q, seqlen_k, heads[0], heads[1], head_dim, dtype, device)
    out = triflash.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    check(1)
    assert_grads_3x((q.grad, k.grad, v.grad), q, k, v, dout, causal, dtype)


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("variant,head_dim", _hopper_variants())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_backward_ragged_keys_with_very_negative_scores(force_kernels, device, monkeypatch, variant, head_dim,
                                                               causal):
    """Every score about -24 and a key count that is no multiple of the key tiles: the padded key rows
    (read as zeros, score 0) must not get p = exp2(-lse2) ~ 6e6, whose dS overflows fp16 and turns dQ
    into NaN through inf * 0 (the dK/dV kernels and the dQ kernels each mask them)."""
    check = _force_hopper_backward(monkeypatch, force_kernels, variant)
    scale = (64 / head_dim) ** 0.5                   # scores ~ -24 at either head dim
    q = torch.full((1, 4100, 2, head_dim), -3.0 * scale, dtype=torch.float16, device=device)
    q = (q + 0.01 * torch.randn_like(q)).requires_grad_()
    k = (1.0 + 0.01 * torch.randn(1, 4100, 2, head_dim, device=device)).half().requires_grad_()
    v = torch.randn(1, 4100, 2, head_dim, dtype=torch.float16, device=device, requires_grad=True)
    out = triflash.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    check(1)
    assert_grads_3x((q.grad, k.grad, v.grad), q, k, v, dout, causal, torch.float16)


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("variant,head_dim", _hopper_variants(reproducible=True))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_backward_is_deterministic(force_kernels, device, monkeypatch, variant, head_dim, causal):
    """33 key blocks of 128 per sequence (for the fused form: 33 CTAs add into every dQ block): 20
    passes give bit-identical gradients."""
    check = _force_hopper_backward(monkeypatch, force_kernels, variant)
    _assert_20_passes_equal(*_inputs(2, 4096 + 13, 4096 + 13, 8, 2, head_dim, torch.float16, device), causal=causal)
    check(20)


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
def test_not_deterministic_takes_the_one_pass_backward_unforced(device, monkeypatch):
    """Unforced, with torch's deterministic switch off (the conftest turns it on for every test): head
    dim 64 at 8k queries and keys takes the one-pass backward with TMA-reduced dQ
    (dispatch.ONE_PASS_ATOMIC), within the 3x rule; deterministic=True takes the reproducible kernels."""
    from triflash.kernels import backward_hopper, launch

    ran = record_calls(monkeypatch, backward_hopper, "backward_hopper", lambda args, kwargs: kwargs.get("variant"))
    monkeypatch.setattr(launch, "ENABLED", False)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        q, k, v = _inputs(1, 8192, 8192, 4, 2, 64, torch.float16, device)
        dout = torch.randn_like(q)
        grads = torch.autograd.grad(triflash.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
        assert ran == [dispatch.ONE_PASS_ATOMIC]
        assert_grads_3x(grads, q, k, v, dout, True, torch.float16)
        ran.clear()
        torch.autograd.grad(triflash.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
        assert ran == ["dkdv_long"]
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("variant", ["split_atomic", "split_tma"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_atomic_one_pass_repeats_within_bound(force_kernels, device, monkeypatch, variant, causal):
    """The fused form with atomic dQ (split_atomic: per-element atomics; split_tma: TMA reduce-adds):
    over 20 passes dK and dV are bit-identical (no atomics in them) and dQ stays within the 3x rule's
    bound of the deterministic fused form's, with 33 key blocks adding into every dQ block."""
    check = _force_hopper_backward(monkeypatch, force_kernels, variant)
    q, k, v = _inputs(2, 4096 + 13, 4096 + 13, 8, 2, 64, torch.float16, device)
    dout = torch.randn(q.shape, dtype=q.dtype, device=device)
    out = triflash.flash_attn_func(q, k, v, causal=causal)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    bound = grad_bounds(q, k, v, dout, causal)[0]
    for _ in range(19):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        assert torch.equal(again[1], first[1]) and torch.equal(again[2], first[2])
        assert_within("dq", again[0], first[0], bound)
    check(20)
    with dispatch.force(backward="split"):
        reproducible = torch.autograd.grad(out, (q, k, v), dout)
    assert_within("dq", first[0], reproducible[0], bound)
    assert torch.equal(first[1], reproducible[1]) and torch.equal(first[2], reproducible[2])


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on sm_90 only")
@pytest.mark.parametrize("variant,head_dim", _hopper_variants())
@pytest.mark.parametrize("wanted", ["q", "kv"])
def test_hopper_backward_partial_gradients(force_kernels, device, monkeypatch, variant, head_dim, wanted):
    """Only dQ, or only dK and dV: each kernel of the Hopper path run alone (the dQ kernels then read
    the padded statistics without the dK/dV kernel beside them) gives the full backward's gradients
    bit for bit (the atomic dQ form's dQ within the 3x rule's bound), and the kernels that are not
    needed do not run."""
    from triflash.kernels import backward_hopper

    check = _force_hopper_backward(monkeypatch, force_kernels, variant)
    q, k, v = _inputs(1, 1000, 1500, 8, 2, head_dim, torch.float16, device)
    dout = torch.randn_like(q)
    ref = torch.autograd.grad(triflash.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    check(1)
    before = {name: len(calls) for name, calls in check.launches.items()}
    leaves = [t.detach().requires_grad_(name in wanted) for t, name in zip((q, k, v), "qkv")]
    got = torch.autograd.grad(triflash.flash_attn_func(*leaves, causal=True),
                              [t for t in leaves if t.requires_grad], dout)
    exact = variant is None or backward_hopper.reproducible(variant)
    for g, r, name in zip(got, [r for r, name in zip(ref, "qkv") if name in wanted], wanted):
        if exact or name != "q":
            assert torch.equal(g, r)
        else:
            assert_within("dq", g, r, grad_bounds(q, k, v, dout, True)[0])
    ran = {name: len(calls) - before[name] for name, calls in check.launches.items()}
    fused = variant is not None and backward_hopper.computes_dq(variant)
    gluon_dq = variant is not None and not fused and backward_hopper.dq_on_gluon(variant, head_dim)
    if wanted == "q":
        assert ran == {"backward_hopper": int(fused), "dq_hopper": int(gluon_dq)}
    else:
        assert ran == {"backward_hopper": int(variant is not None), "dq_hopper": 0}


def test_hopper_backward_chooser(monkeypatch):
    """dispatch.backward_variant: None off sm_90 (here: a CPU device); with the sm_90 check
    stubbed to pass, the dK/dV-only Gluon kernel at head_dim 64 and 128 at every length, with dQ
    from the Gluon dQ kernel at 128 and, at 64, from 4k keys (``dkdv_long``); its picks are exactly
    the candidates the GPU tests force."""
    from triflash.kernels import backward_hopper, configs

    pick = dispatch.backward_variant
    kw = dict(dtype=torch.float16, device="cpu")
    assert pick(head_dim=64, causal=True, seqlen_q=4096, seqlen_k=4096, **kw) == "triton"
    monkeypatch.setattr(configs, "gluon_hopper_applies",
                        lambda *, head_dim, dtype, device: head_dim in (64, 128))
    monkeypatch.setattr(configs, "gluon_tma_reduce_available", lambda: True)
    for d in (64, 128):
        for sq, sk in ((4096, 4096), (1024, 1024), (1, 16384), (16384, 77), (4095, 4095), (8192, 8192),
                       (100, 4096)):
            for causal in (False, True):
                want = "dkdv_long" if d == 64 and sk >= 4096 else "dkdv"
                assert pick(head_dim=d, causal=causal, seqlen_q=sq, seqlen_k=sk, **kw) == want
    assert pick(head_dim=80, causal=False, seqlen_q=16384, seqlen_k=16384, **kw) == "triton"
    assert not backward_hopper.computes_dq("dkdv") and backward_hopper.computes_dq("split")
    assert backward_hopper.computes_dq("split_atomic")
    assert all(backward_hopper.reproducible(v) for v in ("dkdv", "dkdv_long", "split"))
    assert not backward_hopper.reproducible("split_atomic")
    assert backward_hopper.computes_dq("split_tma") and not backward_hopper.reproducible("split_tma")
    assert not backward_hopper.computes_dq("dkdv_long")
    assert backward_hopper.dq_on_gluon("dkdv", 128) and not backward_hopper.dq_on_gluon("dkdv", 64)
    assert backward_hopper.dq_on_gluon("dkdv_long", 64)
    # The same dK/dV kernel: the two variants differ only in where dQ comes from.
    strip = ("dq_kernel", "dq_block_n", "dq_stages")
    assert ({k: v for k, v in backward_hopper.VARIANTS["dkdv_long"][64].items() if k not in strip}
            == {k: v for k, v in backward_hopper.VARIANTS["dkdv"][64].items() if k not in strip})
    lengths = (1, 1000, 4096, 16384)
    for d in (64, 128):
        names = dispatch.backward_candidates(d)
        assert all(d in backward_hopper.VARIANTS[n] for n in names)
        picks = {pick(head_dim=d, causal=c, seqlen_q=sq, seqlen_k=sk, dtype=dt, device="cpu", deterministic=det)
                 for c in (False, True) for sq in lengths for sk in lengths
                 for dt in (torch.float16, torch.bfloat16) for det in (False, True)}
        assert picks - {"triton"} == set(names)


def test_not_deterministic_takes_the_one_pass_atomic_backward(monkeypatch):
    """With a head dim in dispatch.GLUON_ATOMIC_BACKWARD and GLUON_ATOMIC_MIN_KEYS queries and keys,
    ``deterministic=False`` (``one_pass``: dense, no window, all three gradients) takes the one-pass
    variant with atomic dQ; ``deterministic=True``, ``one_pass=False``, fewer queries or keys, other
    head dims, a Triton without the TMA reduce-add or an empty set keep the deterministic kernels; the
    GPU tests force it (a candidate, except for windows and packed sequences)."""
    from triflash.kernels import backward_hopper, configs

    monkeypatch.setattr(configs, "gluon_hopper_applies",
                        lambda *, head_dim, dtype, device: head_dim in (64, 128))
    pick = dispatch.backward_variant
    monkeypatch.setattr(configs, "gluon_tma_reduce_available", lambda: True)
    kw = dict(dtype=torch.float16, device="cpu", causal=True, seqlen_q=8192, seqlen_k=8192)
    shipped, min_keys = dispatch.GLUON_ATOMIC_BACKWARD, dispatch.GLUON_ATOMIC_MIN_KEYS
    assert shipped == {64}
    for d in (64, 128):
        for sq, sk in ((min_keys, min_keys - 1), (min_keys - 1, min_keys), (min_keys, min_keys),
                       (4 * min_keys, min_keys)):
            got = pick(head_dim=d, deterministic=False, **dict(kw, seqlen_q=sq, seqlen_k=sk))
            assert (got == dispatch.ONE_PASS_ATOMIC) == (d in shipped and min(sq, sk) >= min_keys), (d, sq, sk)
    # Without Gluon's TMA reduce-add (another Triton), or with the set empty: the deterministic kernels.
    monkeypatch.setattr(configs, "gluon_tma_reduce_available", lambda: False)
    assert pick(head_dim=64, deterministic=False, **kw) == "dkdv_long"
    monkeypatch.setattr(configs, "gluon_tma_reduce_available", lambda: True)
    monkeypatch.setattr(dispatch, "GLUON_ATOMIC_BACKWARD", frozenset())
    assert pick(head_dim=64, deterministic=False, **kw) == "dkdv_long"
    assert dispatch.backward_candidates(64) == ("dkdv", "dkdv_long")
    monkeypatch.setattr(dispatch, "GLUON_ATOMIC_BACKWARD", frozenset({64}))
    assert dispatch.ONE_PASS_ATOMIC in backward_hopper.VARIANTS
    assert backward_hopper.computes_dq(dispatch.ONE_PASS_ATOMIC)
    assert not backward_hopper.reproducible(dispatch.ONE_PASS_ATOMIC)
    assert pick(head_dim=64, deterministic=False, **kw) == dispatch.ONE_PASS_ATOMIC
    assert pick(head_dim=64, deterministic=True, **kw) == "dkdv_long"
    assert pick(head_dim=64, deterministic=False, one_pass=False, **kw) == "dkdv_long"
    assert pick(head_dim=64, deterministic=False, **dict(kw, seqlen_k=min_keys - 1)) == "dkdv_long"
    assert pick(head_dim=128, deterministic=False, **kw) == "dkdv"
    assert dispatch.backward_candidates(64) == ("dkdv", "dkdv_long", dispatch.ONE_PASS_ATOMIC)
    assert dispatch.backward_candidates(64, one_pass=False) == ("dkdv", "dkdv_long")
    assert dispatch.backward_candidates(128) == ("dkdv",)


def test_preprocess_pads_rows(device):
    """The Hopper kernel reads delta / lse2 in whole query tiles: with rows_out > Sq the padding rows get
    delta = 0 and lse2 = +inf (so their p is 0), and the real rows equal the unpadded ones."""
    from triflash.kernels.backward import preprocess

    out = torch.randn(2, 70, 3, 64, dtype=torch.float16, device=device)
    dout = torch.randn_like(out)
    lse = torch.randn(2, 3, 70, dtype=torch.float32, device=device)
    lse[0, 1, 5] = float("-inf")                     # a row that saw no key
    delta, lse2 = preprocess(dout, out, lse, None, 70, False)
    delta_p, lse2_p = preprocess(dout, out, lse, None, 128, False)
    assert delta_p.shape == (2, 3, 128) and lse2_p.shape == (2, 3, 128)
    assert torch.equal(delta_p[..., :70], delta) and torch.equal(lse2_p[..., :70], lse2)
    assert torch.equal(delta_p[..., 70:], torch.zeros_like(delta_p[..., 70:]))
    assert torch.isinf(lse2_p[..., 70:]).all() and (lse2_p[..., 70:] > 0).all()
    assert lse2[0, 1, 5] == float("inf")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dq_kernel_reads_padded_stats(device, monkeypatch, force_kernels, causal):
    """With a dK/dV-only Gluon variant the preprocess pads delta and lse2 to the Gluon kernel's query
    tile (128 rows at head_dim 64), and the Triton dQ kernel must read them with that row stride. The
    Gluon kernel is replaced here by the Triton dK/dV kernel, so every gradient must equal the plain
    Triton backward's bit for bit (this runs under the interpreter too)."""
    from triflash.kernels import backward_hopper, configs
    from triflash.kernels.dispatch import forward

    q, k, v = (t.detach() for t in _inputs(2, 70, 90, 4, 2, 64, torch.float16, device))
    dout = torch.randn_like(q)
    scale = 64 ** -0.5
    out, lse = forward(q, k, v, scale, causal)
    triton_cfg = configs.backward_config(head_dim=64, dtype=q.dtype, device=q.device)
    ref = dispatch.backward(dout, q, k, v, out, lse, scale, causal, config=triton_cfg)

    calls = []

    def dkdv_by_triton(dout_, q_, k_, v_, lse2, delta, sm_scale, causal_, dq, dk, dv, *, variant, scores, window):
        assert window is None
        calls.append((variant, tuple(lse2.shape), dq))
        _, dk2, dv2 = dispatch.backward(dout_, q_, k_, v_, out, lse, sm_scale, causal_, need_dq=False,
                                        config=triton_cfg)
        dk.copy_(dk2)
        dv.copy_(dv2)
        return dq, dk, dv

    force_kernels(backward="dkdv")
    monkeypatch.setattr(backward_hopper, "supported", lambda *args: True)
    monkeypatch.setattr(backward_hopper, "backward_hopper", dkdv_by_triton)
    got = dispatch.backward(dout, q, k, v, out, lse, scale, causal)
    assert calls == [("dkdv", (2, 4, 128), None)]          # padded rows; dq left to the Triton kernel
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert_no_nan(name, g)
        assert torch.equal(g, r), name


@pytest.mark.skipif(not __import__("triflash.kernels.configs", fromlist=["x"]).gluon_available(),
                    reason="this Triton has no Gluon (the Hopper launchers import it)")
def test_hopper_launchers_pass_the_problem_sizes(monkeypatch):
    """The Gluon launchers' host side, on any machine (launch.run records instead of launching): the
    forward, dK/dV and dQ launches get each tensor in its own descriptor and the problem's sizes
    (Sq != Sk, GQA), dense and packed (the [1, total, H, D] views, the longest lengths, cu_seqlens).
    A mix-up here (the query length passed as the key length) is invisible to a SASS comparison and
    to the CPU suite's kernels, and wrong on the GPU whenever Sq != Sk."""
    from triflash.kernels import backward_hopper, forward_hopper, launch
    from triflash.kernels.common import Varlen

    calls = []
    monkeypatch.setattr(launch, "run", lambda kernel, grid, **kw: calls.append((kernel.fn.__name__, grid, kw)))
    batch, sq, sk, hq, hk = 2, 1000, 1500, 8, 2
    # Expected block counts, worked out by hand: dense Sq 1000 / Sk 1500, packed longest 617 / 500.
    kv_blocks = {"dense": 12, "packed": 4}             # 128-key blocks of the dK/dV kernel
    dq_blocks = {"dense": 8, "packed": 5}              # 128-row CTAs of the Gluon dQ kernel
    # Forward: (query blocks, work items) per tile height; causal persistent launches take 128-row
    # tiles in pairs (a block and its mirror) and 192-row ones one at a time (snake order).
    fwd_items = {("dense", 128, False): (8, 128), ("packed", 128, False): (5, 120),
                 ("dense", 128, True): (8, 64), ("packed", 128, True): (5, 72),
                 ("dense", 192, True): (6, 96), ("packed", 192, True): (4, 96)}
    for d in (64, 128):
        q = torch.randn(batch, sq, hq, d, dtype=torch.float16)
        k, v = torch.randn(batch, sk, hk, d, dtype=torch.float16), torch.randn(batch, sk, hk, d, dtype=torch.float16)
        do = torch.randn_like(q)
        # lse2 and delta are distinct tensors so that a swap of the two shows.
        stats = (torch.zeros(batch, hq, backward_hopper.padded_rows(sq)),
                 torch.zeros(batch, hq, backward_hopper.padded_rows(sq)))
        cu_q = torch.tensor([0, 300, 300, 917], dtype=torch.int32)
        cu_k = torch.tensor([0, 500, 600, 1000], dtype=torch.int32)
        vl = Varlen(cu_q, cu_k, 617, 500)
        packed = (q[0, :917], k[0, :1000], v[0, :1000], do[0, :917])
        pstats = (torch.zeros(1, hq, backward_hopper.padded_rows(917, packed=True)),
                  torch.zeros(1, hq, backward_hopper.padded_rows(917, packed=True)))
        for variant in backward_hopper.VARIANTS:
            if d not in backward_hopper.VARIANTS[variant]:
                continue
            dq_k = not backward_hopper.computes_dq(variant)
            cases = [("dense", (q, k, v, do), stats, None, (batch, sq, sk))]
            if dq_k:
                cases.append(("packed", packed, pstats, vl, (3, 617, 500)))
            for name, (q_, k_, v_, do_), (lse2, delta), varlen, (b_, sq_, sk_) in cases:
                calls.clear()
                backward_hopper.backward_hopper(do_, q_, k_, v_, lse2, delta, 0.1, True, torch.empty_like(q_),
                                                torch.empty_like(k_), torch.empty_like(v_), variant=variant,
                                                varlen=varlen)
                kernel, grid, kw = calls[0]
                assert kernel == "_attn_bwd_hopper_kernel"
                view = (lambda t: t) if varlen is None else (lambda t: t[None])
                for desc, t in (("q_desc", q_), ("k_desc", k_), ("v_desc", v_), ("do_desc", do_)):
                    assert kw[desc].base.shape == view(t).shape and kw[desc].base.data_ptr() == t.data_ptr(), \
                        (variant, name, desc)
                for desc, t in (("lse_desc", lse2), ("delta_desc", delta)):
                    assert kw[desc].base.data_ptr() == t.data_ptr(), (variant, name, desc)
                assert (kw["batch"], kw["seqlen_q"], kw["seqlen_k"]) == (b_, sq_, sk_), (variant, name)
                assert (kw["num_heads_q"], kw["num_heads_k"], kw["kv_group_size"]) == (hq, hk, hq // hk)
                assert kw["num_n_blocks"] == kv_blocks[name], (variant, name)
                assert grid == (b_ * hk * kv_blocks[name],), (variant, name)
                assert kw.get("PACKED", False) == (varlen is not None)
                if backward_hopper.variant_config(variant, d)["tma_dq"]:
                    # The writer's TMA reduce-adds: a [B * Hq, rows, D] view of a zeroed fp32 workspace
                    # covering every query block, one [64, D] step tile a box.
                    rows = -(-sq_ // 64) * 64
                    work = kw["DQW"]
                    assert work.shape == [b_ * hq, rows, d] and work.block_shape == [1, 64, d]
                    assert work.strides == [rows * d, d, 1] and work.base.dtype == torch.float32
                    assert work.base.is_contiguous() and not work.base.any()
                if varlen is not None:         # packed: the stats by pointer too (plain loads)
                    assert kw["CU_SEQLENS_Q"] is cu_q and kw["CU_SEQLENS_K"] is cu_k
                    assert kw["LSE2"] is lse2 and kw["DELTA"] is delta
                if dq_k and backward_hopper.dq_on_gluon(variant, d):
                    calls.clear()
                    backward_hopper.dq_hopper(do_, q_, k_, v_, lse2, delta, 0.1, True, torch.empty_like(q_),
                                              variant=variant, varlen=varlen)
                    kernel, grid, kw = calls[0]
                    assert kernel == "_attn_bwd_dq_hopper_kernel"
                    assert kw["DQ"].shape == view(q_).shape
                    for desc, t in (("q_desc", q_), ("k_desc", k_), ("v_desc", v_), ("do_desc", do_),
                                    ("lse_desc", lse2), ("delta_desc", delta)):
                        assert kw[desc].base.data_ptr() == t.data_ptr(), (variant, name, desc)
                    assert (kw["seqlen_q"], kw["seqlen_k"]) == (sq_, sk_), (variant, name)
                    assert kw["num_m_blocks"] == dq_blocks[name], (variant, name)
                    assert grid == (b_ * hq * dq_blocks[name],), (variant, name)
                    assert kw.get("LSE2") is (lse2 if varlen is not None else None)
                    assert kw.get("DELTA") is (delta if varlen is not None else None)
        for variant in forward_hopper.VARIANTS:
            if d not in forward_hopper.VARIANTS[variant]:
                continue
            cfg = forward_hopper.variant_config(variant, d)
            for name, (q_, k_, v_), varlen, (_, sq_, sk_) in (("dense", (q, k, v), None, (batch, sq, sk)),
                                                               ("packed", packed[:3], vl, (3, 617, 500))):
                calls.clear()
                out, lse = forward_hopper.forward_hopper(q_, k_, v_, 0.1, True, variant=variant, varlen=varlen)
                kernel, grid, kw = calls[0]
                assert kw["LSE"] is lse and kw.get("O") is (out if varlen is not None else None)
                for desc, t in (("q_desc", q_), ("k_desc", k_), ("v_desc", v_), ("o_desc", out)):
                    assert kw[desc].base.data_ptr() == t.data_ptr(), (variant, name, desc)
                assert (kw["seqlen_q"], kw["seqlen_k"]) == (sq_, sk_), (variant, name)
                assert kw.get("PACKED", False) == (varlen is not None)
                m_blocks, items = fwd_items[(name, cfg["block_m"], cfg["persistent"])]
                assert (kw["num_m_blocks"], kw["num_items"]) == (m_blocks, items), (variant, name)
                assert grid == (min(items, 132) if cfg["persistent"] else items,), (variant, name)
                assert kw["LSE"].shape == ((hq, 917) if varlen is not None else (batch, hq, sq)), (variant, name)


@pytest.mark.skipif(not __import__("triflash.kernels.configs", fromlist=["x"]).gluon_available(),
                    reason="this Triton has no Gluon (the Hopper launchers import it)")
@pytest.mark.parametrize("bad", ["rows", "delta-shape", "strided"])
def test_hopper_launchers_reject_wrong_stats(monkeypatch, bad):
    """lse2 / delta the Gluon kernels would read out of bounds (too few rows, a delta of another
    shape, a strided view) fail before any launch, naming both and their shapes."""
    from triflash.kernels import backward_hopper, launch

    monkeypatch.setattr(launch, "run", lambda *a, **kw: pytest.fail("launched with bad stats"))
    q = torch.randn(1, 200, 4, 64, dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    rows = backward_hopper.padded_rows(200)
    lse2, delta = torch.zeros(1, 4, rows), torch.zeros(1, 4, rows)
    if bad == "rows":
        lse2, delta = torch.zeros(1, 4, 200), torch.zeros(1, 4, 200)
    elif bad == "delta-shape":
        delta = torch.zeros(1, 4, rows // 2)
    else:
        delta = torch.zeros(1, 4, 2 * rows)[..., ::2]
    with pytest.raises(ValueError, match=r"lse2 / delta must be contiguous.*got lse2 \(.*\), delta \("):
        backward_hopper.backward_hopper(q, q, k, v, lse2, delta, 0.1, True, torch.empty_like(q),
                                        torch.empty_like(k), torch.empty_like(v), variant="dkdv")
