"""Score variants: logit soft-capping (``softcap``), ALiBi (``alibi_slopes``) and attention sinks
(``sinks``) in flash_attn_func, attention, flash_attn_varlen_func and flash_attn_with_kvcache, forward
and backward, against the float64 reference with the same variants (helpers' 2x / 3x rules; dsink
against autograd through the reference). They run on the portable Triton kernels on every GPU and, on
sm_90, the forward on the Gluon kernels too ([Note: score variants] in kernels/common.py). The matrix
crosses each variant, and all three together, with causal, windows, GQA, Sq != Sk, rows that see no key
and the three dtypes; the interpreter's tiles (64 x 32) are crossed by these sizes."""

import pytest
import torch
from conftest import DTYPES, ON_GPU
from helpers import (
    DTYPE_ID,
    FLOOR,
    LSE_FLOOR,
    assert_2x_rule,
    assert_grads_3x,
    assert_raises_naming,
    make_qkv,
    max_err,
    ref_grads,
    relative,
    score_variant,
)

import triflash
from triflash.reference import flash_attn_ref, kvcache_ref

HEADS_Q, HEADS_KV = 4, 2


def _variant(name, device, batch=2, heads=HEADS_Q):
    return score_variant(name, device, batch, heads)


def _check_forward(out, lse, q, k, v, **kwargs):
    ref, ref_lse = flash_attn_ref(q, k, v, return_lse=True, **kwargs)
    same, same_lse = flash_attn_ref(q, k, v, compute_dtype=None, return_lse=True, **kwargs)
    assert_2x_rule("out", out, ref, same, q.dtype)
    assert_2x_rule("lse", lse, ref_lse, same_lse, q.dtype, LSE_FLOOR, relative_floor=True)


def _check_backward(grads, q, k, v, dout, dlse, causal=False, window_size=(-1, -1), **variants):
    """dq, dk, dv (and dsink) under helpers.assert_grads_3x's rule."""
    assert_grads_3x(grads, q, k, v, dout, causal, q.dtype, dlse, None, window_size, **variants)


# (Sq, Sk, causal, window): plain, causal with Sq < Sk, causal with Sq > Sk (rows that see no key),
# a local window, one query against many keys.
SHAPES = [(37, 70, False, (-1, -1)), (37, 70, True, (-1, -1)), (70, 37, True, (-1, -1)),
          (64, 96, False, (20, 5)), (1, 50, False, (-1, -1))]
VARIANTS = ["softcap", "alibi", "alibi2", "sinks", "alibi_sinks", "all"]


def _cases():
    cases = []
    for i, (name, (sq, sk, causal, window)) in enumerate((n, s) for n in VARIANTS for s in SHAPES):
        dtypes = DTYPES if ON_GPU else [DTYPES[i % len(DTYPES)]]
        for dtype in dtypes:
            cases.append(pytest.param(name, sq, sk, causal, window, dtype,
                                      id=f"{name}-Sq{sq}-Sk{sk}-{'causal' if causal else 'full'}"
                                         f"-w{window[0]}_{window[1]}-{DTYPE_ID[dtype]}"))
    return cases


def _forward_and_backward(device, name, seqlen_q, seqlen_k, causal, head_dim, dtype, window=(-1, -1)):
    """flash_attn_func with score variant ``name``: out and lse under the 2x rule, then dq, dk, dv (and
    dsink) under the 3x rule, with a gradient on the lse too."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, HEADS_Q, HEADS_KV, head_dim, dtype, device, requires_grad=True)
    kwargs = _variant(name, device)
    sinks = kwargs.pop("sinks", None)
    if sinks is not None:
        sinks.requires_grad_()
    out, lse = triflash.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True, sinks=sinks,
                                        **kwargs)
    _check_forward(out, lse, q, k, v, causal=causal, window_size=window, sinks=sinks, **kwargs)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    _check_backward(grads, q, k, v, dout, dlse, causal=causal, window_size=window, sinks=sinks, **kwargs)


@pytest.mark.parametrize("name,seqlen_q,seqlen_k,causal,window,dtype", _cases())
def test_variant_forward_and_backward(device, name, seqlen_q, seqlen_k, causal, window, dtype):
    _forward_and_backward(device, name, seqlen_q, seqlen_k, causal, 32, dtype, window)


# On sm_90 at head dims 64 and 128 (fp16/bf16) the forward's Gluon kernels take the variants too
# (sm90_common.Scores, fold_sink): every variant the chooser can take, each forced, on each score
# variant, with rows that see no key (Sq > Sk causal), Sq < Sk, one query row, and tiles crossed by
# the lengths; the backward (Triton kernels) then runs on the Gluon forward's LSE.
HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
HOPPER_SHAPES = [(300, 700, True), (700, 300, True), (333, 333, False), (1, 500, False)]


def _hopper_cases(kind):
    """(kind, Gluon variant, score variant, Sq, Sk, causal, head dim, dtype) for every Gluon ``kind``
    ("forward": the chooser's candidates; "backward": those and every other one a caller may force,
    the fused "split" at 64); none off sm_90."""
    from triflash.kernels import backward_hopper, configs, dispatch

    cases = []
    for head_dim, dtype in ((64, torch.float16), (64, torch.bfloat16), (128, torch.float16), (128, torch.bfloat16)):
        if not (HOPPER and configs.gluon_hopper_applies(head_dim=head_dim, dtype=dtype, device="cuda")):
            continue
        if kind == "forward":
            gluons = dispatch.forward_candidates(head_dim, dtype)
        else:
            forced = [n for n, cfgs in backward_hopper.VARIANTS.items() if head_dim in cfgs]
            gluons = dict.fromkeys([*dispatch.backward_candidates(head_dim), *forced])
        for gluon in gluons:
            for name in VARIANTS:
                for sq, sk, causal in HOPPER_SHAPES:
                    cases.append(pytest.param(kind, gluon, name, sq, sk, causal, head_dim, dtype,
                                              id=f"{kind}-{gluon}-{name}-Sq{sq}-Sk{sk}-"
                                                 f"{'causal' if causal else 'full'}-D{head_dim}-{DTYPE_ID[dtype]}"))
    return cases


HOPPER_CASES = _hopper_cases("forward") + _hopper_cases("backward") or [
    pytest.param(*[None] * 8, marks=pytest.mark.skip(reason="needs an sm_90 GPU (Gluon kernels)"))]


@pytest.mark.parametrize("kind,gluon,name,seqlen_q,seqlen_k,causal,head_dim,dtype", HOPPER_CASES)
def test_hopper_kernels_with_variants(device, force_kernels, monkeypatch, kind, gluon, name, seqlen_q, seqlen_k,
                                      causal, head_dim, dtype):
    """Each Gluon forward or backward variant, forced, with each score variant (the forward's Scores
    and fold_sink; in the backward softcap and ALiBi recompute P and dS in the Gluon dK/dV and dQ
    kernels, sinks enter through the LSE): output, lse and gradients (and dsink) under the 2x / 3x
    rules against float64, and the forced kernel is the one that ran."""
    from triflash.kernels import backward_hopper, forward_hopper

    module = forward_hopper if kind == "forward" else backward_hopper
    entry = f"{kind}_hopper"
    taken = []
    real = getattr(module, entry)
    monkeypatch.setattr(module, entry, lambda *a, **kw: taken.append(kw["variant"]) or real(*a, **kw))
    force_kernels(**{kind: gluon})
    _forward_and_backward(device, name, seqlen_q, seqlen_k, causal, head_dim, dtype)
    assert taken == [gluon]


def test_rows_that_see_no_key(device):
    """A row that sees no key: with a sink its output is 0 and its lse the sink (its dsink share is
    dlse); without, 0 and -inf. Causal with more queries than keys, and no keys at all."""
    sinks = torch.randn(HEADS_Q, device=device, requires_grad=True)
    q, k, v = make_qkv(1, 40, 8, HEADS_Q, HEADS_KV, 16, torch.float16, device, requires_grad=True)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, sinks=sinks, softcap=2.0, return_lse=True)
    empty = slice(0, 40 - 8)                                        # rows 0 .. 31 see no key
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.equal(lse[:, :, empty], sinks.detach()[None, :, None].expand(1, HEADS_Q, 32))
    dlse = torch.randn_like(lse)
    dsink, = torch.autograd.grad(lse, sinks, dlse)
    ref = ref_grads(q, k, v, torch.zeros_like(out), True, torch.float64, dlse, sinks=sinks, softcap=2.0)
    assert max_err(dsink, ref[3]) <= 1e-5 * max(1.0, ref[3].abs().max().item())

    no_keys = k[:, :0], v[:, :0]
    out, lse = triflash.flash_attn_func(q, *no_keys, sinks=sinks, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sinks.detach()[None, :, None].expand_as(lse))
    dsink, = torch.autograd.grad(lse, sinks, dlse)
    torch.testing.assert_close(dsink, dlse.sum((0, 2)))
    out, lse = triflash.flash_attn_func(q, *no_keys, softcap=2.0, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("softmax_scale", [None, 2.0**-100])
def test_slopes_that_mask_all_but_the_diagonal(device, force_kernels, softmax_scale):
    """Very large slopes, and a tiny softmax_scale (the Hopper kernels keep ALiBi's scores in raw
    units, the slope divided by softmax_scale, which overflows float32 then and is capped at its
    largest value, ``ScoreArgs.tile``): every key but a row's own is masked in effect, so each row's
    output is its own key's value, its lse that key's score, dv is dout (summed over the query heads
    of a K/V head) and dq, dk are 0; never NaN. On sm_90 the Gluon kernels, forced. No 2x rule here:
    PyTorch's same-dtype attention overflows fp16 on these slopes (inf * 0 on the diagonal), so the
    answers are checked directly; lse within float32 rounding of the float64 score, and dq, dk within
    1e-3 of 0 (their dS is dP - delta of one key: two fp32 sums of the same products)."""
    head_dim = 128 if HOPPER else 32
    if HOPPER:
        force_kernels(forward="pp_persist", backward="dkdv")
    q, k, v = make_qkv(1, 70, 70, HEADS_Q, HEADS_KV, head_dim, torch.float16, device, requires_grad=True)
    slopes = torch.full((HEADS_Q,), 1e30, device=device)
    out, lse = triflash.flash_attn_func(q, k, v, softmax_scale=softmax_scale, alibi_slopes=slopes, return_lse=True)
    group = HEADS_Q // HEADS_KV
    assert torch.equal(out, v.detach().repeat_interleave(group, dim=2))
    scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
    own = (q.detach().double() * k.detach().double().repeat_interleave(group, dim=2)).sum(-1) * scale
    torch.testing.assert_close(lse, own.transpose(1, 2).float(), rtol=1e-5, atol=1e-5 * scale)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    torch.testing.assert_close(dv, dout.unflatten(2, (HEADS_KV, group)).sum(3))
    for name, g in (("dq", dq), ("dk", dk)):
        assert max_err(g, torch.zeros_like(g)) <= 1e-3, name


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_a_softcap_far_below_the_scale(device, dtype):
    """softcap = 2^-126 (the smallest allowed) with softmax_scale 4: scale / softcap overflows float32.
    Every capped score is within 2^-126 of 0, so attention is uniform over the keys a row sees, for
    zero query rows (a zero raw score: inf * 0 = NaN if the kernels took the overflowed scale) as for
    the others; forward and backward against the float64 reference, never NaN."""
    q, k, v = make_qkv(1, 37, 50, HEADS_Q, HEADS_KV, 32, dtype, device, requires_grad=True)
    with torch.no_grad():
        q[:, ::3] = 0.0                                  # zero query rows: raw scores exactly 0
    kwargs = dict(softmax_scale=4.0, softcap=2.0 ** -126)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_lse=True, **kwargs)
    _check_forward(out, lse, q.detach(), k.detach(), v.detach(), causal=True, **kwargs)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert not any(torch.isnan(g).any() for g in grads)
    assert_grads_3x(grads, q.detach(), k.detach(), v.detach(), dout, True, dtype, dlse, 4.0, softcap=2.0 ** -126)


def test_seeds_layout_gives_the_same_bits(device):
    q, k, v = make_qkv(2, 33, 47, HEADS_Q, HEADS_KV, 32, torch.float16, device)
    kwargs = _variant("all", device)
    out = triflash.flash_attn_func(q, k, v, causal=True, **kwargs)
    out_bhsd = triflash.attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, **kwargs)
    assert torch.equal(out_bhsd, out.transpose(1, 2))


def test_no_variant_is_the_plain_call(device):
    """softcap=0.0 and None slopes / sinks are the plain call (the same bits), and the plain kernels
    get no variant argument at all: every variant argument is None (no kernel parameter) and every
    flag False, so their compiled code is the code without variants."""
    from triflash.kernels.common import PLAIN

    assert all(not a for a in (*PLAIN.transform_kwargs(0.125).values(), *PLAIN.sink_kwargs().values()))
    q, k, v = make_qkv(1, 40, 40, 2, 1, 32, torch.float16, device)
    assert torch.equal(triflash.flash_attn_func(q, k, v, causal=True),
                       triflash.flash_attn_func(q, k, v, causal=True, softcap=0.0, alibi_slopes=None, sinks=None))


def test_variants_on_packed_sequences(device):
    """flash_attn_varlen_func: ALiBi per sequence ([B, H] slopes, each sequence's own lengths), sinks
    and softcap; every sequence against the dense reference, dsink summed over the sequences."""
    lengths = [(30, 45), (0, 5), (17, 9), (6, 0)]
    lq, lk = zip(*lengths)
    cu = [torch.tensor([0] + torch.tensor(x).cumsum(0).tolist(), dtype=torch.int32, device=device) for x in (lq, lk)]
    dtype = torch.bfloat16
    q = torch.randn(sum(lq), HEADS_Q, 32, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(sum(lk), HEADS_KV, 32, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(sum(lk), HEADS_KV, 32, dtype=dtype, device=device, requires_grad=True)
    kwargs = _variant("all", device, batch=len(lengths))
    sinks = kwargs.pop("sinks").requires_grad_()
    out, lse = triflash.flash_attn_varlen_func(q, k, v, *cu, max(lq), max(lk), causal=True, return_lse=True,
                                               sinks=sinks, **kwargs)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (q, k, v, sinks), (dout, dlse))
    dsink_ref = torch.zeros(HEADS_Q, dtype=torch.float64, device=device)
    dsink_same = torch.zeros(HEADS_Q, dtype=torch.float32, device=device)
    for b in range(len(lengths)):
        rows, keys = slice(cu[0][b], cu[0][b + 1]), slice(cu[1][b], cu[1][b + 1])
        if lq[b] == 0:
            continue
        seq = dict(kwargs, alibi_slopes=kwargs["alibi_slopes"][b:b + 1])
        qb, kb, vb = q[None, rows], k[None, keys], v[None, keys]
        _check_forward(out[None, rows], lse[None, :, rows], qb, kb, vb, causal=True, sinks=sinks, **seq)
        ref = ref_grads(qb, kb, vb, dout[None, rows], True, torch.float64, dlse[None, :, rows], sinks=sinks,
                        **seq)
        dsink_ref += ref[3]
        dsink_same += ref_grads(qb, kb, vb, dout[None, rows], True, None, dlse[None, :, rows], sinks=sinks,
                                **seq)[3]
        if lk[b]:
            _check_backward((grads[0][None, rows], grads[1][None, keys], grads[2][None, keys]), qb, kb, vb,
                            dout[None, rows], dlse[None, :, rows], causal=True, sinks=sinks, **seq)
    # dsink summed over the sequences, under the 3x rule against PyTorch's same-dtype sum (bf16 inputs,
    # its sinks in float32), with the floor relative to the largest reference entry.
    floor = relative(FLOOR[dtype], dsink_ref)
    assert max_err(grads[3], dsink_ref) <= 3 * max_err(dsink_same, dsink_ref) + floor


def _paged_decode_inputs(device, dtype):
    """The paged decode test's inputs: 3 sequences of 300 + 2, 0 + 2 and 37 + 2 keys in pages of 16
    (long enough that three splits each get keys under the GPU's 128-key tiles too)."""
    batch, page, pages, per_seq = 3, 16, 72, 24
    k_cache = torch.randn(pages, page, HEADS_KV, 32, dtype=dtype, device=device)
    v_cache = torch.randn(pages, page, HEADS_KV, 32, dtype=dtype, device=device)
    block_table = torch.randperm(pages, device=device)[:batch * per_seq].reshape(batch, per_seq).to(torch.int32)
    cache_seqlens = torch.tensor([300, 0, 37], dtype=torch.int32, device=device)
    q = torch.randn(batch, 2, HEADS_Q, 32, dtype=dtype, device=device)
    k_new = torch.randn(batch, 2, HEADS_KV, 32, dtype=dtype, device=device)
    v_new = torch.randn(batch, 2, HEADS_KV, 32, dtype=dtype, device=device)
    return q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_variants_in_paged_decode(device, dtype, num_splits):
    """flash_attn_with_kvcache over a paged cache with an append, causal, every variant at once:
    against the reference, with one split (the sink in the kernel) and three (the sink in the merge,
    once). A sequence of length 0 gets out 0 and lse = sink."""
    batch = 3
    q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table = _paged_decode_inputs(device, dtype)
    kwargs = _variant("all", device, batch=batch)
    ref_args = (q, k_cache.clone(), v_cache.clone(), k_new, v_new, cache_seqlens, block_table)
    out, lse = triflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
                                                causal=True, num_splits=num_splits, return_lse=True, **kwargs)
    ref, ref_lse = kvcache_ref(*ref_args, causal=True, return_lse=True, **kwargs)
    same, same_lse = kvcache_ref(*ref_args, causal=True, return_lse=True, compute_dtype=None, **kwargs)
    assert_2x_rule("out", out, ref, same, dtype)
    assert_2x_rule("lse", lse, ref_lse, same_lse, dtype, LSE_FLOOR, relative_floor=True)
    empty = triflash.flash_attn_with_kvcache(q[1:2], k_cache, v_cache, cache_seqlens=0, block_table=block_table[1:2],
                                             num_splits=num_splits, return_lse=True, sinks=kwargs["sinks"])
    assert torch.equal(empty[0], torch.zeros_like(empty[0]))
    assert torch.equal(empty[1], kwargs["sinks"][None, :, None].expand(1, HEADS_Q, 2))


def test_split_count_of_the_decode_check(device, monkeypatch):
    """The paged decode test's num_splits=3 gives three splits (the decode lowers a count to what its
    longest sequence fills), so the merge, not the kernel, adds the sink there."""
    from triflash.kernels import dispatch

    seen = []
    real = dispatch.merge

    def merge(*args, **kwargs):
        seen.append((args[0].shape[0], kwargs.get("sinks") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "merge", merge)
    triflash.flash_attn_with_kvcache(*_paged_decode_inputs(device, torch.float16), causal=True, num_splits=3,
                                     **_variant("all", device, batch=3))
    assert seen == [(3, True)]


def test_sinks_train(device):
    """A few steps of SGD on the sinks alone (the slopes and softcap fixed) lower the loss: the
    gradient points the right way (gpt-oss-style training of the sinks)."""
    q, k, v = make_qkv(2, 24, 24, HEADS_Q, HEADS_KV, 16, torch.float32, device)
    target = torch.randn(2, 24, HEADS_Q, 16, device=device)
    sinks = torch.zeros(HEADS_Q, device=device, requires_grad=True)
    opt = torch.optim.SGD([sinks], lr=0.5)
    losses = []
    for _ in range(4):
        loss = (triflash.flash_attn_func(q, k, v, causal=True, sinks=sinks) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_slopes_changed_in_place_before_the_backward_raise(device):
    """The backward reads the slopes the forward saw: slopes modified in place in between raise
    autograd's version error instead of giving gradients of other slopes."""
    q, k, v = make_qkv(1, 16, 16, HEADS_Q, HEADS_KV, 16, torch.float32, device)
    q.requires_grad_(True)
    slopes = torch.rand(HEADS_Q, device=device)
    out = triflash.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    slopes.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# -- torch.compile and the custom ops ----------------------------------------------------------------

def test_compiled_call_with_variants_matches_eager(device):
    torch._dynamo.reset()
    q, k, v = make_qkv(1, 20, 24, HEADS_Q, HEADS_KV, 16, torch.float32, device, requires_grad=True)
    slopes = torch.rand(HEADS_Q, device=device)
    sinks = torch.randn(HEADS_Q, device=device, requires_grad=True)

    def f(q, k, v, sinks):
        return triflash.flash_attn_func(q, k, v, causal=True, softcap=4.0, alibi_slopes=slopes, sinks=sinks)
    compiled = torch.compile(f, backend="inductor" if ON_GPU else "aot_eager", fullgraph=True)
    outs, grads = [], []
    for fn in (compiled, f):
        out = fn(q, k, v, sinks)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v, sinks)))
    if not ON_GPU:
        # aot_eager runs the same kernels in the same order: the same bits.
        assert torch.equal(outs[0], outs[1])
        for name, a, b in zip(("dq", "dk", "dv", "dsink"), *grads):
            assert torch.equal(a, b), name
        return
    # Inductor may fuse the surrounding square().sum() differently, which rounds differently.
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_opcheck_with_variants(device):
    q = torch.randn(1, 20, 2, 32, device=device, dtype=torch.float16, requires_grad=True)
    k = torch.randn(1, 24, 1, 32, device=device, dtype=torch.float16, requires_grad=True)
    v = torch.randn(1, 24, 1, 32, device=device, dtype=torch.float16, requires_grad=True)
    slopes = torch.rand(1, 2, device=device)
    sinks = torch.randn(2, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.triflash.attn_fwd.default, (q, k, v, 0.2, True, False, -1, -1, 3.0, slopes, sinks))
    out, lse = torch.ops.triflash.attn_fwd(q.detach(), k.detach(), v.detach(), 0.2, True, False, 7, 0, 3.0, slopes,
                                           sinks.detach())
    torch.library.opcheck(torch.ops.triflash.attn_bwd.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, None, 0.2, True,
                           False, True, True, 7, 0, 3.0, slopes, sinks.detach()))


def test_opcheck_varlen_with_variants(device):
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=device)
    q = torch.randn(20, 2, 16, device=device, dtype=torch.float16, requires_grad=True)
    k = torch.randn(20, 1, 16, device=device, dtype=torch.float16, requires_grad=True)
    v = torch.randn(20, 1, 16, device=device, dtype=torch.float16, requires_grad=True)
    sinks = torch.randn(2, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.triflash.varlen_fwd.default,
                          (q, k, v, cu, cu, 13, 13, 0.25, True, -1, -1, 2.0, torch.rand(2, 2, device=device), sinks))


def test_vmap_and_per_sample_dsink(device):
    """torch.func: vmap over grad gives each sample's dsink (a loop over the samples: a folded batch
    would sum them)."""
    q, k, v = make_qkv(3, 12, 12, 2, 1, 16, torch.float32, device)
    sinks = torch.randn(2, device=device)

    def loss(sinks, q, k, v):
        return triflash.flash_attn_func(q[None], k[None], v[None], causal=True, sinks=sinks).sum()
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0, 0))(sinks, q, k, v)
    for i in range(3):
        s = sinks.clone().requires_grad_()
        (g,) = torch.autograd.grad(loss(s, q[i], k[i], v[i]), s)
        torch.testing.assert_close(per_sample[i], g, rtol=1e-5, atol=1e-6)


# -- bad input ---------------------------------------------------------------------------------------

def test_variant_arguments_are_checked(device):
    q, k, v = make_qkv(2, 8, 8, 4, 2, 16, torch.float16, device)
    f = triflash.flash_attn_func
    assert_raises_naming(TypeError, ["softcap", "real number", "str"], f, q, k, v, softcap="1")
    assert_raises_naming(TypeError, ["softcap", "bool"], f, q, k, v, softcap=True)
    assert_raises_naming(ValueError, ["softcap", ">= 0", "-1.0"], f, q, k, v, softcap=-1.0)
    assert_raises_naming(ValueError, ["softcap", "finite", "inf"], f, q, k, v, softcap=float("inf"))
    assert_raises_naming(ValueError, ["softcap", "nan"], f, q, k, v, softcap=float("nan"))
    # past float32 (the kernels' type for it): NaN outputs before the range check
    assert_raises_naming(ValueError, ["softcap", "2^127", "1e+39"], f, q, k, v, softcap=1e39)
    assert_raises_naming(TypeError, ["alibi_slopes", "torch.Tensor", "list"], f, q, k, v, alibi_slopes=[0.1] * 4)
    assert_raises_naming(TypeError, ["alibi_slopes.dtype", "float32", "float16"], f, q, k, v,
                         alibi_slopes=torch.rand(4, device=device, dtype=torch.float16))
    assert_raises_naming(ValueError, ["alibi_slopes", "(4,)", "(2, 4)", "(3,)"], f, q, k, v,
                         alibi_slopes=torch.rand(3, device=device))
    assert_raises_naming(ValueError, ["alibi_slopes", "(2, 4)", "(1, 4)"], f, q, k, v,
                         alibi_slopes=torch.rand(1, 4, device=device))
    assert_raises_naming(ValueError, ["alibi_slopes", "requires grad", "not differentiable"], f, q, k, v,
                         alibi_slopes=torch.rand(4, device=device, requires_grad=True))
    with torch.no_grad():                                     # not recorded: accepted
        f(q, k, v, alibi_slopes=torch.rand(4, device=device, requires_grad=True))
    assert_raises_naming(TypeError, ["sinks.dtype", "float32", "float64"], f, q, k, v,
                         sinks=torch.zeros(4, device=device, dtype=torch.float64))
    assert_raises_naming(ValueError, ["sinks", "(4,)", "(2,)"], f, q, k, v, sinks=torch.zeros(2, device=device))
    assert_raises_naming(ValueError, ["sinks", "(4,)", "(2, 4)"], f, q, k, v, sinks=torch.zeros(2, 4, device=device))
    if ON_GPU:
        assert_raises_naming(ValueError, ["sinks", "same device"], f, q, k, v, sinks=torch.zeros(4))
        assert_raises_naming(ValueError, ["alibi_slopes", "same device"], f, q, k, v, alibi_slopes=torch.zeros(4))
    # attention: heads from [B, H, S, D]; varlen: batch from cu_seqlens
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    assert_raises_naming(ValueError, ["sinks", "(4,)", "(8,)"], triflash.attention, qh, kh, vh,
                         sinks=torch.zeros(8, device=device))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    assert_raises_naming(ValueError, ["alibi_slopes", "(2, 4)", "(3, 4)"], triflash.flash_attn_varlen_func,
                         q[0], k[0], v[0], cu, cu, 5, 5, alibi_slopes=torch.rand(3, 4, device=device))
    # decode: no backward, so sinks that require grad are refused too
    cache = torch.randn(2, 16, 2, 16, dtype=torch.float16, device=device)
    kv = triflash.flash_attn_with_kvcache
    assert_raises_naming(ValueError, ["sinks", "requires grad", "flash_attn_with_kvcache"], kv, q, cache, cache,
                         sinks=torch.zeros(4, device=device, requires_grad=True))
    assert_raises_naming(ValueError, ["softcap", ">= 0"], kv, q, cache, cache, softcap=-2.0)
    assert_raises_naming(ValueError, ["alibi_slopes", "(4,)"], kv, q, cache, cache,
                         alibi_slopes=torch.zeros(5, device=device))


def test_backward_with_sinks_needs_its_dsink_tensor():
    """dispatch.backward writes dsink into the caller's tensor: without one it raises, naming it (it
    failed with an AttributeError on empty inputs and dropped the gradient on others)."""
    from triflash.kernels import dispatch
    from triflash.kernels.common import ScoreVariant

    q = torch.randn(1, 4, 2, 16)
    lse = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="dsink"):
        dispatch.backward(q, q, q, q, q, lse, 0.25, False, scores=ScoreVariant(sinks=torch.zeros(2)))


def test_which_forward_takes_the_variants(device, monkeypatch):
    """The chooser's rule (dispatch.GLUON_FORWARD_SCORES), with the Hopper kernel stubbed in (any
    machine): at head dim 128 every variant reaches the Gluon forward; at 64 sinks and ALiBi do and
    softcap keeps the Triton kernel (measured slower on Gluon there) unless a Gluon variant is forced."""
    from triflash.kernels import configs, dispatch, forward_hopper, sm90_common
    from triflash.kernels.common import ScoreVariant

    taken = []

    def stub(q, k, v, sm_scale, causal, out=None, *, variant, scores, window, varlen):
        assert window is None and varlen is None
        taken.append((variant, scores))
        return out, torch.zeros(q.shape[0], q.shape[2], q.shape[1], device=q.device)

    monkeypatch.setattr(configs, "gluon_hopper_applies", lambda *, head_dim, dtype, device: True)
    monkeypatch.setattr(sm90_common, "tma_supported", lambda *tensors: True)
    monkeypatch.setattr(forward_hopper, "forward_hopper", stub)
    # Not causal: at 40 tokens the chooser's pick is a Gluon one at both head dims.
    for head_dim in (128, 64):
        q, k, v = make_qkv(1, 40, 40, 2, 1, head_dim, torch.float16, device)
        slopes, sinks = torch.rand(2, device=device), torch.randn(2, device=device)
        for scores in (ScoreVariant(0.0, slopes), ScoreVariant(0.0, None, sinks), ScoreVariant(0.0, slopes, sinks)):
            taken.clear()
            dispatch.forward(q, k, v, 0.125, False, scores=scores)
            assert len(taken) == 1 and taken[0][1] is scores
        taken.clear()
        capped = ScoreVariant(4.0, slopes, sinks)
        out, lse = dispatch.forward(q, k, v, 0.125, False, scores=capped)
        if head_dim == 128:
            assert len(taken) == 1 and taken[0][1] is capped
            continue
        assert taken == []
        _check_forward(out, lse, q, k, v, causal=False, softmax_scale=0.125, softcap=4.0, alibi_slopes=slopes,
                       sinks=sinks)
        dispatch.forward(q, k, v, 0.125, False, scores=capped, variant="pp_persist")
        assert taken == [("pp_persist", capped)]


def test_which_backward_takes_the_variants(device, monkeypatch):
    """The backward's rule (dispatch.GLUON_BACKWARD_SCORES), with the Gluon kernels stubbed in (any
    machine): sinks and softcap reach the Gluon kernels at head dims 64 and 128, ALiBi at 128 only
    (the Triton kernels at 64 unless a Gluon variant is forced), each with its variants; with sinks,
    dsink comes from the preprocess' delta rows padded to the Gluon tiles, equal to the Triton path's."""
    from triflash.kernels import backward_hopper, configs, dispatch
    from triflash.kernels.common import ScoreVariant

    taken = []

    def stub(dout, q, k, v, lse2, delta, sm_scale, causal, *grads, variant, scores, window=None):
        assert window is None
        taken.append((variant, delta.shape[-1], scores))
        for g in grads:
            if g is not None:
                g.zero_()

    for head_dim in (128, 64):
        q, k, v = make_qkv(2, 150, 150, 2, 1, head_dim, torch.float16, device)
        sinks, slopes = torch.randn(2, device=device), torch.rand(2, device=device)
        scores = ScoreVariant(0.0, None, sinks)
        out, lse = dispatch.forward(q, k, v, 0.125, True, scores=scores)
        dout = torch.randn_like(out)
        want = torch.empty(2, device=device)
        dispatch.backward(dout, q, k, v, out, lse, 0.125, True, scores=scores, dsink=want)   # Triton
        with monkeypatch.context() as m:
            m.setattr(configs, "gluon_hopper_applies", lambda *, head_dim, dtype, device: True)
            m.setattr(configs, "gluon_available", lambda: True)
            m.setattr(dispatch, "SINGLE_MAX_WORK", -1)       # short GPU problems: the single launch first
            m.setattr(backward_hopper, "supported", lambda *args: True)
            m.setattr(backward_hopper, "backward_hopper", stub)
            m.setattr(backward_hopper, "dq_hopper", stub)
            taken.clear()
            plain = dispatch.backward(dout, q, k, v, out, lse, 0.125, True)
            assert taken and all(g is not None for g in plain)                     # the stub ran
            got = torch.empty(2, device=device)
            padded = backward_hopper.padded_rows(150)
            for variant in (scores, ScoreVariant(2.0, None, sinks), ScoreVariant(0.0, slopes, sinks)):
                taken.clear()
                got.fill_(float("nan"))
                dispatch.backward(dout, q, k, v, out, lse, 0.125, True, scores=variant, dsink=got)
                if variant.alibi_slopes is not None and head_dim == 64:
                    assert taken == []                                             # the Triton kernels
                    assert torch.equal(got, want)
                    dispatch.backward(dout, q, k, v, out, lse, 0.125, True, scores=variant, dsink=got,
                                      variant="dkdv")
                assert taken and all(rows == padded and sc is variant for _, rows, sc in taken)
                assert padded > 150 and torch.equal(got, want)                    # the same sinks, same lse


def test_dsink_sums_every_block_of_rows(device, monkeypatch):
    """The backward's dsink (``backward.preprocess``: each block of rows' share, then
    ``_sink_grad_kernel`` adds the shares per head in several steps when there are many) equals
    -sum over (b, i) of exp(sink - lse) * (rowsum(dO * O) - dlse) in float64, with rows of no key
    (lse = -inf) adding nothing and a ragged last block of rows; and it is the same to the bit
    whether the stats' rows are padded (the Hopper backward pads them to its tiles) or not."""
    from triflash.kernels import backward, configs

    batch, seqlen, heads, dim = 3, 2 * configs.BWD_PREPROCESS_BLOCK_M + 22, 2, 16
    for seed in range(4):           # the padding's effect on the bits (before it was left out) varies by seed
        gen = torch.Generator().manual_seed(seed)
        out, dout = (torch.randn(batch, seqlen, heads, dim, generator=gen).to(device) for _ in range(2))
        lse = torch.randn(batch, heads, seqlen, generator=gen).to(device)
        lse[1, 0, 7] = float("-inf")
        dlse = torch.randn(batch, heads, seqlen, generator=gen).to(device)
        sinks = torch.randn(heads, generator=gen).to(device)
        got = {}
        # Stats rows as the Triton path has them, padded by one block (the Hopper path pads them to
        # its tiles), and summed two shares per step (several steps per head: 3 batches x 3 blocks).
        for name, rows, step in (("plain", seqlen, 1024), ("padded", seqlen + configs.BWD_PREPROCESS_BLOCK_M, 1024),
                                 ("stepped", seqlen, 2)):
            monkeypatch.setattr(backward, "SINK_GRAD_BLOCK", step)
            got[name] = torch.full((heads,), float("nan"), device=device)
            backward.preprocess(dout, out, lse, dlse, rows, False, sinks=sinks, dsink=got[name])
        assert torch.equal(got["padded"], got["plain"]), seed
        delta = (out.double() * dout.double()).sum(-1).transpose(1, 2) - dlse.double()     # [B, H, S]
        p_sink = torch.exp(sinks.double()[None, :, None] - lse.double())
        p_sink[lse == float("-inf")] = 0.0               # a row that saw no key has no softmax to join
        want = -(p_sink * delta).sum(dim=(0, 2))
        # The kernel's fp32 sums of ~600 terms of size ~1 against float64: fp32 rounding (~1e-7 a term)
        # adds up to ~1e-6 at most, so 1e-5 leaves a margin and still catches a lost or doubled block.
        for name in ("plain", "stepped"):
            torch.testing.assert_close(got[name].double(), want, rtol=1e-5, atol=1e-5)
