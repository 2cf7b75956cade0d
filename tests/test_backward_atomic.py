"""The atomic dQ backward (kernels/backward.py's [Note: atomic dQ]): ``dispatch.backward(deterministic=False)``
or the variant ``"atomic"``, where the dK/dV kernel also adds dQ into a float32 workspace with atomics.

Its gradients meet the backward's 3x rule against float64 (test_backward.py's docstring) on the same
semantics as the deterministic kernels: GQA, causal (bottom-right), windows, packed sequences with
empty ones, Sq != Sk, rows that see no key, a gradient on the LSE, strided dO, fp16 / bf16 / fp32 and
the score variants. Against the deterministic path (the documented bound): dQ, and on the GPU dK and dV,
within the 3x rule's bound (3x PyTorch's same-dtype error against float64, plus the floor). dK and dV
are the same arithmetic in a kernel compiled with more code: bit for bit in the interpreter, but ptxas
may contract or order the float32 operations differently (it did on the H100). Every test also checks
which kernels ran, so a silent fallback to the deterministic kernels fails. Shapes are small: under the
interpreter the whole file takes about a minute.
"""

import pytest
import torch
from conftest import ON_GPU
from helpers import (
    BACKWARD_PATH_CASES,
    assert_grads_3x,
    assert_no_nan,
    assert_packed_grads_3x,
    assert_within,
    backward_path_case,
    grad_bounds,
    make_qkv,
    packed_sequences,
    score_variant,
)

import triflash
from triflash.kernels import backward as B
from triflash.kernels import configs, dispatch, launch
from triflash.kernels.configs import BwdConfig

ATOMIC_RUN = ["_bwd_preprocess_kernel+zero_dq", "_bwd_dkdv_kernel+atomic_dq", "_bwd_dq_convert_kernel"]
DETERMINISTIC_RUN = ["_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"]


SHIPPED_ATOMIC_BY_DEFAULT = dispatch.ATOMIC_BY_DEFAULT


@pytest.fixture(autouse=True)
def atomic_by_default(monkeypatch):
    """``deterministic=False`` takes the atomic kernels here (dispatch.ATOMIC_BY_DEFAULT on): the switch
    the choosers would flip once the atomic kernels are the faster ones; the shipped value is checked
    in test_chooser_takes_atomic_only_when_asked. The single-launch backward, which short GPU problems
    take before these rules are asked (test_backward_single.py), is off here."""
    monkeypatch.setattr(dispatch, "ATOMIC_BY_DEFAULT", True)
    monkeypatch.setattr(dispatch, "SINGLE_MAX_WORK", -1)


def _dq_bound(q, k, v, dout, causal, dlse=None, window_size=(-1, -1)) -> float:
    """The documented bound on |dq_atomic - dq_deterministic|: the 3x rule's (helpers.grad_bounds)."""
    return grad_bounds(q, k, v, dout, causal, dlse, window_size=window_size)[0]


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,head_dim,causal,dtype,dout_kind,with_dlse",
                         BACKWARD_PATH_CASES)
def test_atomic_matches_reference(device, force_kernels, launched, batch, seqlen_q, seqlen_k, heads, head_dim,
                                  causal, dtype, dout_kind, with_dlse):
    q, k, v, outputs, grads_in = backward_path_case(batch, seqlen_q, seqlen_k, heads, head_dim, causal, dtype,
                                                    dout_kind, with_dlse, device)
    force_kernels(backward="atomic")
    launched.clear()
    grads = torch.autograd.grad(outputs, (q, k, v), grads_in)
    assert launched == ATOMIC_RUN
    assert_grads_3x(grads, q, k, v, grads_in[0], causal, dtype, dlse=grads_in[1] if with_dlse else None)
    if causal and seqlen_q > seqlen_k:                   # the first Sq - Sk rows see no key
        empty = grads[0][:, :seqlen_q - seqlen_k]
        assert torch.equal(empty, torch.zeros_like(empty))


@pytest.mark.parametrize("config", [None, "descriptors"], ids=["chosen-tiles", "tma-descriptors"])
def test_not_deterministic_takes_atomic_and_matches_deterministic(device, launched, config):
    """``deterministic=False`` (nothing forced; ``ATOMIC_BY_DEFAULT`` on, this file's fixture) runs the
    atomic kernels, at the chooser's tiles or at explicit ones with host-built TMA descriptors (the
    interpreter runs those too); against the deterministic path: all three within the documented bound
    (dK, dV: bit for bit in the interpreter, where no compiler reorders their arithmetic). Head dim 40:
    no Gluon kernel takes it, so on Hopper too the choice is the Triton one."""
    q, k, v = make_qkv(2, 130, 200, 6, 2, 40, torch.float16, device)
    dout = torch.randn_like(q)
    scale = 40 ** -0.5
    out, lse = dispatch.forward(q, k, v, scale, True)
    cfg = None if config is None else (BwdConfig(32, 64, 4, 2, True), BwdConfig(64, 32, 4, 2, True))
    launched.clear()
    det = dispatch.backward(dout, q, k, v, out, lse, scale, True, config=cfg)
    assert launched == DETERMINISTIC_RUN
    launched.clear()
    fast = dispatch.backward(dout, q, k, v, out, lse, scale, True, config=cfg, deterministic=False)
    assert launched == ATOMIC_RUN
    for name, a, b, bound in zip(("dq", "dk", "dv"), fast, det, grad_bounds(q, k, v, dout, True)):
        assert_within(name, a, b, bound)
        if not ON_GPU and name != "dq":
            assert torch.equal(a, b), name


@pytest.mark.parametrize("window,causal,dtype", [((20, 5), False, torch.bfloat16), ((16, 0), True, torch.float16)],
                         ids=["w20_5-full-bf16", "w16_0-causal-fp16"])
def test_atomic_local_window(device, force_kernels, launched, window, causal, dtype):
    q, k, v = make_qkv(2, 64, 96, 4, 2, 32, dtype, device, requires_grad=True)
    out = triflash.flash_attn_func(q, k, v, causal=causal, window_size=window)
    dout = torch.randn_like(out)
    force_kernels(backward="atomic")
    launched.clear()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert launched == ATOMIC_RUN
    assert_grads_3x(grads, q, k, v, dout, causal, dtype, window_size=window)


def test_atomic_varlen_with_empty_sequences(device, force_kernels, launched):
    """Packed sequences (one without queries, one without keys, Sq > Sk and Sq < Sk), GQA, causal, a
    loss on out and lse: each sequence against its own reference, zeros where a sequence has no scores."""
    lengths = [(17, 17), (0, 9), (70, 45), (5, 0), (40, 71)]
    q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences(lengths, (4, 2), 32, torch.float16, device, requires_grad=True)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    force_kernels(backward="atomic")
    launched.clear()
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert launched == ATOMIC_RUN
    assert_packed_grads_3x((dq, dk, dv), q, k, v, dout, cu_q, cu_k, True, torch.float16, dlse)


def test_atomic_score_variants(device, force_kernels, launched):
    """Softcap, [B, H] ALiBi slopes and sinks together, causal with rows that see no key: dq, dk, dv
    and dsink under the 3x rule (test_variants' check)."""
    q, k, v = make_qkv(2, 70, 37, 4, 2, 32, torch.float16, device, requires_grad=True)
    kwargs = score_variant("all", device, 2, 4)
    sinks = kwargs.pop("sinks").requires_grad_()
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_lse=True, sinks=sinks, **kwargs)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    force_kernels(backward="atomic")
    launched.clear()
    grads = torch.autograd.grad((out, lse), (q, k, v, sinks), (dout, dlse))
    assert launched == ["_bwd_preprocess_kernel+zero_dq", "_sink_grad_kernel"] + ATOMIC_RUN[1:]
    assert_grads_3x(grads, q, k, v, dout, True, torch.float16, dlse, sinks=sinks, **kwargs)


@pytest.mark.parametrize("wanted", ["dq", "dkdv"])
def test_atomic_partial_gradients(device, launched, wanted):
    """Only dQ: the dQ kernel (less work than the fused loop, and deterministic); only dK and dV: the
    plain dK/dV kernel. Either way the deterministic path's gradients, bit for bit."""
    q, k, v = make_qkv(2, 70, 90, 4, 2, 32, torch.float16, device)
    dout = torch.randn_like(q)
    out, lse = dispatch.forward(q, k, v, 0.125, True)
    need = dict(need_dq=wanted == "dq", need_dkdv=wanted == "dkdv")
    det = dispatch.backward(dout, q, k, v, out, lse, 0.125, True, **need)
    launched.clear()
    fast = dispatch.backward(dout, q, k, v, out, lse, 0.125, True, variant="atomic", **need)
    assert launched == ["_bwd_preprocess_kernel", "_bwd_dq_kernel" if wanted == "dq" else "_bwd_dkdv_kernel"]
    expected = ("dq",) if wanted == "dq" else ("dk", "dv")
    for name, a, b in zip(("dq", "dk", "dv"), fast, det):
        assert (a is not None) == (b is not None) == (name in expected), name
        if a is not None:
            assert_no_nan(name, a)
            assert torch.equal(a, b), name


def test_atomic_with_64_bit_offsets(device, monkeypatch, launched):
    """The LONG form (64-bit row offsets, forced on small inputs, the workspace's rows included)
    against the usual one: dK, dV bit for bit, dQ within the documented bound."""
    q, k, v = make_qkv(2, 70, 90, 4, 2, 32, torch.float16, device)
    dout = torch.randn_like(q)
    out, lse = dispatch.forward(q, k, v, 0.125, False)
    plain = dispatch.backward(dout, q, k, v, out, lse, 0.125, False, variant="atomic")
    seen = []
    real = launch.run

    def long_flags(kernel, grid, *args, **kwargs):
        seen.append(kwargs.get("LONG"))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "run", long_flags)
    monkeypatch.setattr(B, "needs_int64_rows", lambda *tensors: True)
    wide = dispatch.backward(dout, q, k, v, out, lse, 0.125, False, variant="atomic")
    assert seen == [True] * 3
    assert torch.equal(wide[1], plain[1]) and torch.equal(wide[2], plain[2])
    assert_within("dq", wide[0], plain[0], _dq_bound(q, k, v, dout, False))


def test_atomic_call_plan_replays(device):
    """A recorded call plan (kernels/launch.py) of the atomic backward replays it on new dO: the
    workspace is a plan allocation that the replayed preprocess zeroes (torch.empty is NaN-poisoned
    in this suite), so the replay gives the direct call's gradients (dQ within the bound)."""
    q, k, v = make_qkv(1, 50, 70, 4, 2, 32, torch.float16, device)
    out, lse = dispatch.forward(q, k, v, 0.125, True)

    def call(dout, q, k, v, out, lse):
        return dispatch.backward(dout, q, k, v, out, lse, 0.125, True, variant="atomic")

    _, plan = launch.record(call, (torch.randn_like(q), q, k, v, out, lse), ())
    assert plan, launch.LAST_FAILURE
    dout = torch.randn_like(q)
    replayed = plan.replay((dout, q, k, v, out, lse))
    direct = call(dout, q, k, v, out, lse)
    assert torch.equal(replayed[1], direct[1]) and torch.equal(replayed[2], direct[2])
    assert_within("dq", replayed[0], direct[0], _dq_bound(q, k, v, dout, True))


def test_chooser_takes_atomic_only_when_asked(monkeypatch):
    """``backward_variant``: the Triton kernels off Hopper, "atomic" when not deterministic and the
    switch is on; as shipped the switch is off (the atomic kernels measured slower on the H100), so
    the deterministic kernels run either way. On Hopper (stubbed) the Gluon kernels either way.
    "atomic" is a backward variant name everywhere, so the bench (``triflash@atomic``,
    scripts/tune.py) forces it."""
    assert SHIPPED_ATOMIC_BY_DEFAULT is False
    from triflash.bench.providers import forced_provider

    assert dispatch.ATOMIC in dispatch.variant_names()[1]
    provider = forced_provider("triflash@atomic")
    provider.load()
    assert provider.force == {"backward": dispatch.ATOMIC}
    pick = dispatch.backward_variant
    kw = dict(head_dim=64, dtype=torch.float16, device="cpu", causal=True, seqlen_q=1024, seqlen_k=1024)
    assert pick(**kw) == dispatch.TRITON and pick(**kw, deterministic=True) == dispatch.TRITON
    assert pick(**kw, deterministic=False) == dispatch.ATOMIC == "atomic"
    monkeypatch.setattr(dispatch, "ATOMIC_BY_DEFAULT", False)
    assert pick(**kw, deterministic=False) == dispatch.TRITON
    monkeypatch.setattr(dispatch, "ATOMIC_BY_DEFAULT", True)
    monkeypatch.setattr(configs, "gluon_hopper_applies", lambda *, head_dim, dtype, device: head_dim in (64, 128))
    for deterministic in (True, False):
        assert pick(**kw, deterministic=deterministic) == "dkdv"
        assert pick(**dict(kw, head_dim=80), deterministic=deterministic) == (
            dispatch.TRITON if deterministic else dispatch.ATOMIC)


@pytest.mark.skipif(not ON_GPU, reason="the interpreter runs a grid's programs one after another: only a "
                                         "GPU runs the atomics concurrently")
def test_atomic_repeats_within_bound_on_gpu(device):
    """20 atomic backward passes: dK, dV bit-identical (no atomics in them), dQ within the bound."""
    q, k, v = make_qkv(2, 1024 + 13, 1024 + 13, 6, 2, 40, torch.float16, device)
    dout = torch.randn_like(q)
    out, lse = dispatch.forward(q, k, v, 40 ** -0.5, True)
    first = dispatch.backward(dout, q, k, v, out, lse, 40 ** -0.5, True, deterministic=False)
    bound = _dq_bound(q, k, v, dout, True)
    for _ in range(19):
        again = dispatch.backward(dout, q, k, v, out, lse, 40 ** -0.5, True, deterministic=False)
        assert torch.equal(again[1], first[1]) and torch.equal(again[2], first[2])
        assert_within("dq", again[0], first[0], bound)
