"""The single-launch backward (kernels/backward.py's [Note: single-launch backward]): one launch of the
dK/dV kernel with SINGLE runs the dK/dV programs and the dQ programs side by side, each making its rows'
delta and lse2 from O, dO and the LSE itself, so no preprocess and no stats buffer.

Its gradients meet the backward's 3x rule against float64 (test_backward.py's docstring) on the
semantics of the three-launch path: GQA/MQA, causal (bottom-right), Sq != Sk with rows that see no key,
windows, softcap and ALiBi, a gradient on the LSE, strided and transposed dO, fp16 / bf16 / fp32. Against
the three-launch path: bit for bit in the interpreter (the same arithmetic in the same order); on the GPU
within the 3x rule's bound (ptxas may order the delta's sum differently). The tests of gradients check
which kernels ran, so a silent fallback fails. The chooser takes it for short GPU problems only
(``dispatch.single_launch_suits``), dense or packed; calls it cannot take (sinks, one gradient only, an
explicit config) keep the three launches, even when forced.
"""

import math

import pytest
import torch
from conftest import ON_GPU
from helpers import (
    BACKWARD_PATH_CASES,
    assert_20_backward_passes_equal,
    assert_grads_3x,
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
from triflash.kernels import dispatch, launch
from triflash.kernels.configs import BwdConfig

SINGLE_RUN = ["_bwd_dkdv_kernel+single"]
THREE_RUN = ["_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"]


def _assert_same_as_three_launches(single, three, bounds):
    for name, a, b, bound in zip(("dq", "dk", "dv"), single, three, bounds):
        if ON_GPU:
            assert_within(name, a, b, bound)
        else:
            assert torch.equal(a, b), name


# helpers.BACKWARD_PATH_CASES, and bf16 and head dim 128.
CASES = BACKWARD_PATH_CASES + [
    pytest.param(2, 64, 64, (4, 2), 64, True, torch.bfloat16, "contiguous", False,
                 id="B2-S64-D64-causal-bf16-gqa2"),
    pytest.param(1, 150, 150, (2, 1), 128, False, torch.float16, "contiguous", False,
                 id="B1-S150-D128-full-fp16-mqa"),
]


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,head_dim,causal,dtype,dout_kind,with_dlse", CASES)
def test_single_matches_reference(device, force_kernels, launched, batch, seqlen_q, seqlen_k, heads, head_dim,
                                  causal, dtype, dout_kind, with_dlse):
    q, k, v, outputs, grads_in = backward_path_case(batch, seqlen_q, seqlen_k, heads, head_dim, causal, dtype,
                                                    dout_kind, with_dlse, device)
    dout, dlse = grads_in[0], grads_in[1] if with_dlse else None
    force_kernels(backward=dispatch.SINGLE)
    launched.clear()
    grads = torch.autograd.grad(outputs, (q, k, v), grads_in, retain_graph=True)
    assert launched == SINGLE_RUN
    assert_grads_3x(grads, q, k, v, dout, causal, dtype, dlse=dlse)
    if causal and seqlen_q > seqlen_k:                   # the first Sq - Sk rows see no key
        empty = grads[0][:, :seqlen_q - seqlen_k]
        assert torch.equal(empty, torch.zeros_like(empty))
    force_kernels(backward=dispatch.TRITON)
    launched.clear()
    three = torch.autograd.grad(outputs, (q, k, v), grads_in)
    assert launched == THREE_RUN
    _assert_same_as_three_launches(grads, three, grad_bounds(q, k, v, dout, causal, dlse))


@pytest.mark.parametrize("window,causal,variant", [((20, 5), False, "softcap"), ((16, 0), True, "alibi2"),
                                                   ((-1, 8), False, "alibi")],
                         ids=["w20_5-full-softcap", "w16_0-causal-alibiBH", "w-1_8-full-alibi"])
def test_single_windows_and_score_variants(device, force_kernels, launched, window, causal, variant):
    q, k, v = make_qkv(2, 64, 96, 4, 2, 32, torch.float16, device, requires_grad=True)
    kwargs = score_variant(variant, device, 2, 4)
    out, lse = triflash.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True, **kwargs)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    force_kernels(backward=dispatch.SINGLE)
    launched.clear()
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert launched == SINGLE_RUN
    assert_grads_3x(grads, q, k, v, dout, causal, torch.float16, dlse, window_size=window, **kwargs)


@pytest.mark.parametrize("causal,window,dtype,variant", [
    (True, (-1, -1), torch.float16, None), (True, (12, 0), torch.float16, None),
    (False, (-1, -1), torch.float32, "softcap"), (False, (20, 3), torch.bfloat16, "alibi2")],
    ids=["causal-fp16", "window12-causal-fp16", "full-fp32-softcap", "window20_3-bf16-alibiBH"])
def test_single_packed_sequences_with_empty_ones(device, force_kernels, launched, causal, window, dtype, variant):
    """Packed sequences (one without queries, one without keys, Sq > Sk and Sq < Sk), GQA, a loss on
    out and lse: each sequence against its own reference, zeros where a sequence has no scores, and
    the three-launch path's gradients."""
    lengths = [(17, 17), (0, 9), (70, 45), (5, 0), (40, 71)]
    q, k, v, cu_q, cu_k, max_q, max_k = packed_sequences(lengths, (4, 2), 32, dtype, device, requires_grad=True)
    kwargs = score_variant(variant, device, len(lengths), 4) if variant else {}
    out, lse = triflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True,
                                               window_size=window, **kwargs)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    force_kernels(backward=dispatch.SINGLE)
    launched.clear()
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse), retain_graph=True)
    assert launched == SINGLE_RUN
    assert_packed_grads_3x(grads, q, k, v, dout, cu_q, cu_k, causal, dtype, dlse, window_size=window, **kwargs)
    force_kernels(backward=dispatch.TRITON)
    launched.clear()
    three = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert launched == THREE_RUN
    if not ON_GPU:
        for name, a, b in zip(("dq", "dk", "dv"), grads, three):
            assert torch.equal(a, b), name


def test_single_takes_a_strided_out(device, launched):
    """O is read by the single launch itself (for delta): a non-contiguous out (a view into a wider
    buffer) gives the contiguous out's gradients."""
    q, k, v = make_qkv(2, 70, 90, 4, 2, 32, torch.float16, device)
    dout = torch.randn_like(q)
    out, lse = dispatch.forward(q, k, v, 0.125, True)
    wide = torch.zeros(2, 70, 4, 3, 32, dtype=out.dtype, device=device)[:, :, :, 1]
    wide.copy_(out)
    assert not wide.is_contiguous()
    launched.clear()
    a = dispatch.backward(dout, q, k, v, wide, lse, 0.125, True, variant=dispatch.SINGLE)
    b = dispatch.backward(dout, q, k, v, out, lse, 0.125, True, variant=dispatch.SINGLE)
    assert launched == SINGLE_RUN * 2
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        assert torch.equal(x, y), name


def test_single_not_taken_where_it_cannot_run(device, force_kernels, launched):
    """Forced, but with sinks (their gradient sums over every row: the preprocess' job) or with one
    gradient wanted: the three-launch path, correct."""
    q, k, v = make_qkv(2, 40, 50, 4, 2, 32, torch.float16, device, requires_grad=True)
    sinks = score_variant("sinks", device, 2, 4)["sinks"].requires_grad_()
    out = triflash.flash_attn_func(q, k, v, causal=True, sinks=sinks)
    dout = torch.randn_like(out)
    force_kernels(backward=dispatch.SINGLE)
    launched.clear()
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout, retain_graph=True)
    assert launched == ["_bwd_preprocess_kernel", "_sink_grad_kernel"] + THREE_RUN[1:]
    assert_grads_3x(grads, q, k, v, dout, True, torch.float16, sinks=sinks)
    plain = triflash.flash_attn_func(q, k.detach(), v.detach(), causal=True)     # dQ alone
    launched.clear()
    (dq,) = torch.autograd.grad(plain, (q,), dout)
    assert launched == ["_bwd_preprocess_kernel", "_bwd_dq_kernel"]
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    scale = 32 ** -0.5                      # flash_attn_func's default at head dim 32
    o, lse = dispatch.forward(qd, kd, vd, scale, True)
    three = dispatch.backward(dout, qd, kd, vd, o, lse, scale, True, variant=dispatch.TRITON)
    assert torch.equal(dq, three[0])        # the same preprocess and dQ kernel as all three gradients
    # An explicit config asks for the three kernels with those tiles.
    launched.clear()
    tiled = dispatch.backward(dout, qd, kd, vd, o, lse, scale, True, variant=dispatch.SINGLE,
                              config=(BwdConfig(16, 32, 4, 1), BwdConfig(32, 16, 4, 1)))
    assert launched == THREE_RUN
    assert_grads_3x(tiled, qd, kd, vd, dout, True, torch.float16)


@pytest.mark.parametrize("limit", [1 << 30, 1 << 24])
def test_chooser_takes_single_for_short_gpu_problems(monkeypatch, limit):
    """The rule: a GPU problem of at most SINGLE_MAX_WORK (causal counted as half), never the CPU (at
    two limits, neither of them the shipped one: the rule, not the measured crossover)."""
    monkeypatch.setattr(dispatch, "SINGLE_MAX_WORK", limit)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")

    def suits(batch, seqlen, heads, dim, causal, device=cuda):
        return dispatch.single_launch_suits(batch=batch, heads_q=heads, seqlen_q=seqlen, seqlen_k=seqlen,
                                            head_dim=dim, causal=causal, device=device)
    assert suits(1, 128, 8, 64, True) and suits(1, 128, 8, 64, False)
    assert not suits(1, 128, 8, 64, True, cpu)
    assert not suits(8, 1024, 16, 128, False) and not suits(8, 1024, 16, 128, True)
    full = math.isqrt(limit // 64)          # the longest one-head sequence taken at D64 without a mask
    assert suits(1, full, 1, 64, False) and not suits(1, full + 1, 1, 64, False)
    causal = math.isqrt(limit // 32)        # with one: half the work
    assert suits(1, causal, 1, 64, True) and not suits(1, causal + 1, 1, 64, True)


def test_shipped_rule_follows_the_measured_crossover():
    """The shipped limit against the H100 table (docs/performance.md, one launch for a short
    backward): the single launch where it was ahead eagerly, three launches where it was behind."""
    cuda = torch.device("cuda", 0)

    def suits(batch, seqlen, heads, dim, causal):
        return dispatch.single_launch_suits(batch=batch, heads_q=heads, seqlen_q=seqlen, seqlen_k=seqlen,
                                            head_dim=dim, causal=causal, device=cuda)
    for ahead in ((1, 128, 8, 64, False), (2, 512, 16, 128, False), (4, 512, 16, 128, False),
                  (2, 1024, 16, 128, True), (4, 1024, 16, 64, True)):
        assert suits(*ahead), ahead
    for behind in ((2, 1024, 16, 128, False), (8, 1024, 16, 128, True), (2, 2048, 16, 128, True)):
        assert not suits(*behind), behind


def test_unforced_backward_takes_single_where_the_rule_says(device, monkeypatch, launched):
    """dispatch.backward asks single_launch_suits with the call's sizes and takes the single launch
    when it says so (the rule itself never says so on the CPU: see the test above)."""
    asked = []

    def rule(**sizes):
        asked.append(sizes)
        return True
    monkeypatch.setattr(dispatch, "single_launch_suits", rule)
    q, k, v = make_qkv(2, 70, 90, 4, 2, 32, torch.float16, device)
    dout = torch.randn_like(q)
    out, lse = dispatch.forward(q, k, v, 0.125, True)
    launched.clear()
    single = dispatch.backward(dout, q, k, v, out, lse, 0.125, True)
    assert launched == SINGLE_RUN
    assert asked == [dict(batch=2, heads_q=4, seqlen_q=70, seqlen_k=90, head_dim=32, causal=True, device=q.device)]
    launched.clear()
    three = dispatch.backward(dout, q, k, v, out, lse, 0.125, True, variant=dispatch.TRITON)
    assert launched == THREE_RUN
    _assert_same_as_three_launches(single, three, grad_bounds(q, k, v, dout, True))


@pytest.mark.skipif(not ON_GPU, reason="the interpreter runs a grid's programs one after another: only a "
                                         "GPU can tell")
def test_single_runs_are_bit_identical(device, force_kernels, launched):
    """Deterministic: no atomics, a fixed order in every sum (a GPU matter: the interpreter runs the
    programs one after another)."""
    q, k, v = make_qkv(2, 100, 100, 4, 2, 64, torch.float16, device, requires_grad=True)
    force_kernels(backward=dispatch.SINGLE)
    out = triflash.flash_attn_func(q, k, v, causal=True)
    launched.clear()
    assert_20_backward_passes_equal(out, (q, k, v))
    assert launched == SINGLE_RUN * 20


def test_single_with_64_bit_offsets(device, monkeypatch, launched):
    """The LONG form (64-bit row offsets, forced on small inputs): the same gradients, bit for bit."""
    q, k, v = make_qkv(2, 70, 90, 4, 2, 32, torch.float16, device)
    dout = torch.randn_like(q)
    out, lse = dispatch.forward(q, k, v, 0.125, False)
    plain = dispatch.backward(dout, q, k, v, out, lse, 0.125, False, variant=dispatch.SINGLE)
    seen = []
    real = launch.run

    def long_flags(kernel, grid, *args, **kwargs):
        seen.append(kwargs.get("LONG"))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "run", long_flags)
    # Only O asks for them: the single launch's own tensors must reach the LONG flag.
    monkeypatch.setattr(B, "needs_int64_rows", lambda *tensors: any(t is out for t in tensors))
    wide = dispatch.backward(dout, q, k, v, out, lse, 0.125, False, variant=dispatch.SINGLE)
    assert seen == [True]
    for a, b in zip(wide, plain):
        assert torch.equal(a, b)


def test_single_call_plan_replays(device):
    """A recorded call plan (kernels/launch.py) of the single launch: three allocations and one
    launch, replayed on new dO with the direct call's gradients, bit for bit."""
    q, k, v = make_qkv(1, 50, 70, 4, 2, 32, torch.float16, device)
    out, lse = dispatch.forward(q, k, v, 0.125, True)

    def call(dout, q, k, v, out, lse):
        return dispatch.backward(dout, q, k, v, out, lse, 0.125, True, variant=dispatch.SINGLE)

    _, plan = launch.record(call, (torch.randn_like(q), q, k, v, out, lse), ())
    assert plan, launch.LAST_FAILURE
    assert len(plan.allocs) == 3 and sum(type(s) is not tuple for s in plan.steps) == 1
    dout = torch.randn_like(q)
    replayed = plan.replay((dout, q, k, v, out, lse))
    direct = call(dout, q, k, v, out, lse)
    for a, b in zip(replayed, direct):
        assert torch.equal(a, b)
