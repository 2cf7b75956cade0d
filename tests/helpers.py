"""Tolerance rule and input makers shared by the test files.

The rule (FlashAttention's test suite uses the same idea): against a float64 reference, triflash's max
error may be at most twice the max error of PyTorch's own attention computed in the same dtype, plus a
small floor. The floor only matters where PyTorch is exact (one key, say): a quarter of the dtype's
epsilon for fp16/bf16 (below one rounding of an output near 1), and 2^-20 for fp32, where the GPU's
exp2 (ex2.approx) alone is good to about 2^-22 relative.
"""

import pytest
import torch

# The grid, shared by the forward and backward suites.
SEQLENS = [(1, 1), (1, 129), (17, 17), (113, 203), (128, 217), (239, 1), (1023, 1024)]
HEAD_DIMS = [16, 40, 64, 80, 128, 256]
HEADS = [(6, 6), (6, 2), (6, 1)]          # MHA, GQA 6:2, MQA 6:1
HEADS_ID = {(6, 6): "mha", (6, 2): "gqa3", (6, 1): "mqa"}
DTYPE_ID = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

FLOOR = {torch.float16: 2.0**-12, torch.bfloat16: 2.0**-9, torch.float32: 2.0**-20}
LSE_FLOOR = {torch.float16: 2.0**-16, torch.bfloat16: 2.0**-16, torch.float32: 2.0**-20}


def max_err(a, b):
    """max |a - b| over finite entries of b; entries where b is +-inf must match exactly."""
    a, b = a.double(), b.double()
    inf = torch.isinf(b)
    if inf.any():
        assert torch.equal(a[inf], b[inf]), "infinite reference entries (empty rows) not reproduced"
    if (~inf).sum() == 0:
        return 0.0
    return (a[~inf] - b[~inf]).abs().max().item()


def assert_no_nan(name, t):
    bad = torch.isnan(t)
    assert not bad.any(), f"{name}: {bad.sum().item()} of {t.numel()} elements are NaN (unwritten or NaN math)"


def assert_within(name, got, want, bound):
    """Two computations of one gradient by different kernels or summation orders (atomics, one launch
    against three): no NaN, and max |got - want| within ``bound`` (the 3x rule's, ``grad_bounds``)."""
    assert_no_nan(name, got)
    diff = max_err(got, want)
    assert diff <= bound, f"{name}: {diff:.3e} apart, more than the bound {bound:.3e}"


def relative(floor, ref):
    """floor x max(1, largest finite |ref|): a floor for values whose rounding error scales with size."""
    finite = ref[torch.isfinite(ref)]
    return floor * max(1.0, finite.abs().max().item() if finite.numel() else 0.0)


def assert_2x_rule(name, got, ref64, ref_same_dtype, dtype, floor_table=FLOOR, relative_floor=False):
    """relative_floor: scale the floor by max(1, max |ref|). Used for the LSE, whose size grows with
    the scores and log(Sk): its rounding error is relative. (On the H200, fp32 LSE with one key and
    D=256 is the raw score times the scale; Triton's IEEE fp32 dot sums the 256 products in sequence
    and lands ~4 ulps off at |lse| ~ 4, where cuBLAS, blocking the sum, lands ~1.)"""
    assert_no_nan(name, got)
    err = max_err(got, ref64)
    base = max_err(ref_same_dtype, ref64)
    floor = relative(floor_table[dtype], ref64) if relative_floor else floor_table[dtype]
    assert err <= 2 * base + floor, (
        f"{name}: max error {err:.3e} > 2 x PyTorch same-dtype error {base:.3e} + floor {floor:.1e}")


def make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device, requires_grad=False):
    """Random q [B, Sq, Hq, D] and k, v [B, Sk, Hkv, D] (FlashAttention's layout)."""
    def randn(seqlen, heads):
        return torch.randn(batch, seqlen, heads, head_dim, dtype=dtype, device=device,
                           requires_grad=requires_grad)
    return randn(seqlen_q, heads_q), randn(seqlen_k, heads_kv), randn(seqlen_k, heads_kv)


def assert_matches_reference(out, lse, q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1),
                             **variants):
    """The forward's out and lse ([B, S, H, D] inputs) against the float64 reference, by the 2x rule.
    ``variants``: score variants (softcap, alibi_slopes, sinks) as the reference takes them."""
    from triflash.reference import flash_attn_ref

    kwargs = dict(causal=causal, softmax_scale=softmax_scale, return_lse=True, window_size=window_size, **variants)
    ref, ref_lse = flash_attn_ref(q, k, v, **kwargs)
    same, same_lse = flash_attn_ref(q, k, v, compute_dtype=None, **kwargs)
    assert_2x_rule("out", out, ref, same, q.dtype)
    assert_2x_rule("lse", lse, ref_lse, same_lse, q.dtype, LSE_FLOOR, relative_floor=True)


def record_calls(monkeypatch, owner, name, what):
    """Wrap ``owner.name`` so that each call appends ``what(args, kwargs)`` to the returned list, then
    runs the real function."""
    calls = []
    real = getattr(owner, name)

    def recording(*args, **kwargs):
        calls.append(what(args, kwargs))
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, recording)
    return calls


def assert_raises_naming(exc, words, fn, *args, **kwargs):
    """fn(*args, **kwargs) raises ``exc``, and its message mentions every one of ``words`` (the
    argument's name, what was expected, what was received)."""
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for word in words:
        assert word in msg, f"message {msg!r} should mention {word!r}"


def ref_grads(q, k, v, dout, causal, compute_dtype, dlse=None, scale=None, window_size=(-1, -1), sinks=None,
              **variants):
    """Gradients of the reference ([B, S, H, D] inputs): [dq, dk, dv], and dsink with ``sinks``;
    compute_dtype=None is PyTorch's own same-dtype attention. ``variants``: softcap, alibi_slopes."""
    leaves = [t.detach().to(compute_dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().to(compute_dtype or torch.float32).requires_grad_())
    from triflash.reference import flash_attn_ref

    out, lse = flash_attn_ref(*leaves[:3], causal=causal, softmax_scale=scale, compute_dtype=compute_dtype,
                              return_lse=True, window_size=window_size,
                              sinks=leaves[3] if sinks is not None else None, **variants)
    loss = (out * dout.to(out.dtype)).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.to(lse.dtype)).sum()
    return list(torch.autograd.grad(loss, leaves))


def _dsink_by_formula(q, k, v, dout, causal, dlse, scale, window_size, sinks, **variants):
    """dsink = -sum over (batch, rows) of exp(sink - lse) * (rowsum(dO * O) - dlse), in float32, from
    PyTorch's own same-dtype forward (out rounded to q's dtype, as a kernel's is)."""
    from triflash.reference import flash_attn_ref

    out, lse = flash_attn_ref(q.detach(), k.detach(), v.detach(), causal=causal, softmax_scale=scale,
                              compute_dtype=None, return_lse=True, window_size=window_size,
                              sinks=sinks.detach().float(), **variants)
    delta = (dout.float() * out.to(q.dtype).float()).sum(-1).transpose(1, 2)          # [B, H, Sq]
    if dlse is not None:
        delta = delta - dlse.float()
    lse = lse.float()
    p_sink = torch.where(torch.isneginf(lse), torch.zeros_like(lse),
                         torch.exp(sinks.detach().float()[None, :, None] - lse))
    return -(p_sink * delta).sum((0, 2))


def assert_grads_3x(grads, q, k, v, dout, causal, dtype, dlse=None, scale=None, window_size=(-1, -1),
                    **variants):
    """The backward's rule (test_backward.py's docstring): dQ, dK and dV (and dsink, where ``grads`` has
    a fourth entry and ``variants`` holds the sinks) each within 3x PyTorch's own same-dtype error
    against float64, plus a floor relative to the largest reference gradient."""
    ref = ref_grads(q, k, v, dout, causal, torch.float64, dlse, scale, window_size, **variants)
    same = ref_grads(q, k, v, dout, causal, None, dlse, scale, window_size, **variants)
    floor = relative(FLOOR[dtype], torch.cat([r.flatten() for r in ref]))
    assert len(grads) >= 3, f"{len(grads)} gradients given, expected dq, dk, dv (and dsink)"
    for name, g, r, s in zip(("dq", "dk", "dv", "dsink"), grads, ref, same):
        assert g is not None and g.shape == r.shape, name
        assert name == "dsink" or g.dtype == dtype, (name, g.dtype)
        assert_no_nan(name, g)
        err, base = max_err(g, r), max_err(s, r)
        if name == "dsink":
            # PyTorch has two same-dtype routes to dsink, with errors of different kinds: autograd
            # through the softmax (rounding spread over every key's dP), and the formula every
            # FlashAttention backward uses, -sum p_sink * rowsum(dO * O), on its own rounded output
            # (rounding of O's elements, summed over rows). The kernels take the second; the rule
            # is 3x the larger of the two.
            formula = _dsink_by_formula(q, k, v, dout, causal, dlse, scale, window_size, **variants)
            base = max(base, max_err(formula, r))
        assert err <= 3 * base + floor, (
            f"{name}: max error {err:.3e} > 3 x PyTorch same-dtype error {base:.3e} + floor {floor:.1e}")


def grad_bounds(q, k, v, dout, causal, dlse=None, **kwargs) -> tuple[float, float, float]:
    """The 3x rule's bounds for (dq, dk, dv) as plain numbers: 3x PyTorch's own same-dtype error
    against float64, plus the floor (for comparing two of triflash's backward paths with each other)."""
    ref = ref_grads(q, k, v, dout, causal, torch.float64, dlse, **kwargs)
    same = ref_grads(q, k, v, dout, causal, None, dlse, **kwargs)
    floor = relative(FLOOR[q.dtype], torch.cat([r.flatten() for r in ref]))
    return tuple(3 * max_err(same[i], ref[i]) + floor for i in range(3))


def dout_of_kind(kind, shape, dtype, device):
    """A random dO of ``shape`` [B, S, H, D]: "contiguous", "transposed" (a [B, H, S, D] tensor's
    transpose) or "strided" (every other row of a tensor twice as long)."""
    batch, seqlen, heads, dim = shape
    if kind == "transposed":
        dout = torch.randn(batch, heads, seqlen, dim, dtype=dtype, device=device).transpose(1, 2)
    elif kind == "strided":
        dout = torch.randn(batch, 2 * seqlen, heads, dim, dtype=dtype, device=device)[:, ::2]
    else:
        dout = torch.randn(shape, dtype=dtype, device=device)
    assert dout.shape == tuple(shape) and dout.is_contiguous() == (kind == "contiguous")
    return dout


# Backward paths against the reference (test_backward_atomic, test_backward_single): (batch, Sq, Sk,
# (Hq, Hkv), head dim, causal, dtype, dO layout, with a gradient on the LSE).
BACKWARD_PATH_CASES = [
    pytest.param(2, 70, 101, (4, 2), 40, True, torch.float16, "transposed", True,
                 id="B2-Sq70-Sk101-D40-causal-fp16-gqa2-dOT-dlse"),
    pytest.param(2, 101, 70, (4, 1), 32, True, torch.float32, "strided", True,
                 id="B2-Sq101-Sk70-D32-causal-fp32-mqa-dOstrided-emptyrows-dlse"),
    pytest.param(1, 77, 130, (2, 2), 64, False, torch.float16, "contiguous", True,
                 id="B1-Sq77-Sk130-D64-full-fp16-mha-dlse"),
]


def backward_path_case(batch, seqlen_q, seqlen_k, heads, head_dim, causal, dtype, dout_kind, with_dlse, device):
    """One of BACKWARD_PATH_CASES made: q, k, v (requiring grad), the forward's (out, lse) with what a
    loss sends back through them (outputs, grads_in: dO, and dLSE when ``with_dlse``)."""
    import triflash

    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads[0], heads[1], head_dim, dtype, device, requires_grad=True)
    out, lse = triflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    dout = dout_of_kind(dout_kind, out.shape, dtype, device)
    if with_dlse:
        return q, k, v, (out, lse), (dout, torch.randn_like(lse))
    return q, k, v, (out,), (dout,)


def assert_packed_grads_3x(grads, q, k, v, dout, cu_q, cu_k, causal, dtype, dlse=None, alibi_slopes=None, skip=(),
                           **kwargs):
    """Gradients (dq, dk, dv) of packed sequences: each sequence's against its own reference by the 3x
    rule (``kwargs``: window_size, softcap, sinks), and zeros for a sequence without queries or keys.
    [B, H] ALiBi slopes give each sequence its row; ``skip``: sequences not checked."""
    dq, dk, dv = grads
    for b, (rows, keys) in enumerate(sequence_slices(cu_q, cu_k)):
        if b in skip:
            continue
        if rows.stop == rows.start or keys.stop == keys.start:
            for name, g in (("dq", dq[rows]), ("dk", dk[keys]), ("dv", dv[keys])):
                assert torch.equal(g, torch.zeros_like(g)), f"{name} of a sequence without scores"
            continue
        assert_grads_3x((dq[rows][None], dk[keys][None], dv[keys][None]), q[rows][None], k[keys][None],
                        v[keys][None], dout[rows][None], causal, dtype,
                        dlse=None if dlse is None else dlse[:, rows][None],
                        alibi_slopes=_sequence_slopes(alibi_slopes, b), **kwargs)


def assert_packed_matches_reference(out, lse, q, k, v, cu_q, cu_k, causal, skip=(), alibi_slopes=None, sinks=None,
                                    **kwargs):
    """The forward's out and lse of packed sequences: each sequence's against its own float64 reference
    by the 2x rule (``kwargs``: window_size, softcap; [B, H] ALiBi slopes give each sequence its row);
    ``skip``: sequences not checked. A sequence with no keys: zeros, and an lse of -inf or, with sinks,
    the sink (to 4 float32 ulps: the Hopper epilogue computes (sink / scale) * scale)."""
    for b, (rows, keys) in enumerate(sequence_slices(cu_q, cu_k)):
        if b in skip or rows.stop == rows.start:
            continue
        if keys.stop == keys.start:
            assert torch.equal(out[rows], torch.zeros_like(out[rows]))
            if sinks is None:
                assert torch.all(lse[:, rows] == float("-inf"))
            else:
                torch.testing.assert_close(lse[:, rows], sinks[:, None].expand(-1, rows.stop - rows.start),
                                           rtol=4 * 2.0**-23, atol=0)
            continue
        assert_matches_reference(out[rows][None], lse[:, rows][None], q[rows][None], k[keys][None], v[keys][None],
                                 causal=causal, alibi_slopes=_sequence_slopes(alibi_slopes, b), sinks=sinks, **kwargs)


def _sequence_slopes(alibi_slopes, b):
    """Sequence b's ALiBi slopes: its row of [B, H] slopes ([1, H]), or the [H] ones as they are."""
    return alibi_slopes[b:b + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes


def assert_20_backward_passes_equal(out, leaves):
    """No atomics: 20 backward passes through ``out`` give bit-identical gradients of ``leaves``."""
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    for _ in range(19):
        again = torch.autograd.grad(out, leaves, dout, retain_graph=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def score_variant(name, device, batch, heads):
    """The keyword arguments of one score-variant case: "softcap", "alibi" ([H] slopes), "alibi2"
    ([B, H]), "sinks", "alibi_sinks" (the pair the Hopper forward takes by default) or "all" (the
    three together)."""
    slopes = torch.rand(heads, device=device) * 0.5
    slopes2 = torch.rand(batch, heads, device=device) * 0.5
    sinks = torch.randn(heads, device=device) * 2
    return {"softcap": dict(softcap=3.0), "alibi": dict(alibi_slopes=slopes),
            "alibi2": dict(alibi_slopes=slopes2), "sinks": dict(sinks=sinks),
            "alibi_sinks": dict(alibi_slopes=slopes2, sinks=sinks),
            "all": dict(softcap=5.0, alibi_slopes=slopes2, sinks=sinks)}[name]


def cu_seqlens(lengths, device):
    """[0, l0, l0 + l1, ...] int32: the offsets of packed sequences of these lengths."""
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def packed_sequences(lengths, heads, head_dim, dtype, device, requires_grad=False):
    """Packed sequences of (queries, keys) ``lengths``: q [total_q, Hq, D], k, v [total_k, Hkv, D],
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k."""
    lq, lk = zip(*lengths)

    def randn(total, h):
        return torch.randn(total, h, head_dim, dtype=dtype, device=device, requires_grad=requires_grad)
    return (randn(sum(lq), heads[0]), randn(sum(lk), heads[1]), randn(sum(lk), heads[1]),
            cu_seqlens(lq, device), cu_seqlens(lk, device), max(lq), max(lk))


def sequence_slices(cu_q, cu_k):
    """(slice of q's rows, slice of k's rows) of each packed sequence."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]
