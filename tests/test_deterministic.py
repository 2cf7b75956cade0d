"""``deterministic=``: which backward runs, on every public road.

The kernels of each path are tested in test_backward.py (deterministic) and test_backward_atomic.py
(atomic dQ); here, that the argument and ``torch.use_deterministic_algorithms`` reach the backward's
chooser, that a call plan recorded for one path never replays for the other, and that a bad value is
refused naming the argument.
"""

import pytest
import torch
from helpers import assert_raises_naming, packed_sequences, record_calls

import triflash
from triflash.kernels import dispatch, launch

F16 = torch.float16


@pytest.fixture
def seen(monkeypatch):
    """The ``deterministic`` each backward hands the chooser (call plans off: a replay skips it)."""
    monkeypatch.setattr(launch, "ENABLED", False)
    return record_calls(monkeypatch, dispatch, "backward", lambda args, kwargs: kwargs.get("deterministic"))


@pytest.fixture(autouse=True)
def global_switch():
    """torch's deterministic-algorithms switch off (the suite's conftest turns it on for every test, to
    poison torch.empty), restored after the test."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(before)


def _dense(device, layout="bshd"):
    shape = (1, 24, 2, 16) if layout == "bshd" else (1, 2, 24, 16)
    return [torch.randn(shape, dtype=F16, device=device, requires_grad=True) for _ in range(3)]


def _packed(device):
    """Two packed sequences of 17 and 23 tokens: q, k, v [40, 2, 16] and their shared offsets."""
    q, k, v, cu, _, _, _ = packed_sequences([(17, 17), (23, 23)], (2, 2), 16, F16, device, requires_grad=True)
    return q, k, v, cu


CALLS = {
    "flash_attn_func": lambda d, **kw: triflash.flash_attn_func(*_dense(d), causal=True, **kw),
    "attention": lambda d, **kw: triflash.attention(*_dense(d, "bhsd"), causal=True, **kw),
    "varlen": lambda d, **kw: (lambda q, k, v, cu: triflash.flash_attn_varlen_func(
        q, k, v, cu, cu, 23, 23, causal=True, **kw))(*_packed(d)),
}


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("flag", [False, True])
def test_the_argument_reaches_the_backward(device, seen, name, flag):
    CALLS[name](device, deterministic=flag).float().sum().backward()
    assert seen == [flag]


@pytest.mark.parametrize("name", list(CALLS))
def test_the_default_lets_the_backward_choose(device, seen, name):
    CALLS[name](device).float().sum().backward()
    assert seen == [False]


@pytest.mark.parametrize("name", list(CALLS))
def test_use_deterministic_algorithms_wins(device, seen, global_switch, name):
    """The global switch, read when the backward runs, overrides deterministic=False."""
    out = CALLS[name](device, deterministic=False)
    torch.use_deterministic_algorithms(True)
    out.float().sum().backward()
    assert seen == [True]


def test_through_the_custom_op(device, seen, global_switch):
    """The op road (a dispatch mode, torch.compile) carries the argument and honours the switch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q, k, v = _dense(device)
    with Passthrough():
        out = triflash.flash_attn_func(q, k, v, causal=True, deterministic=True)
        out.float().sum().backward()
    assert seen == [True]
    seen.clear()
    torch.use_deterministic_algorithms(True)
    with Passthrough():
        triflash.flash_attn_func(q, k, v, causal=True).float().sum().backward()
    assert seen == [True]


def test_plans_of_the_two_paths_are_kept_apart(device, global_switch, monkeypatch):
    """One call shape, its backward run both ways through call plans: each equals its own path's plain
    run, and the forward's entry keys a backward plan per path (a plan recorded deterministic never
    replays for a call that may take atomics, nor the reverse). With dispatch.ATOMIC_BY_DEFAULT on,
    so that the two paths run different kernels."""
    from triflash import api

    monkeypatch.setattr(dispatch, "ATOMIC_BY_DEFAULT", True)

    launch.clear_plans()
    q, k, v = _dense(device)
    dout = torch.randn_like(q)

    def grads(flag):
        return torch.autograd.grad(triflash.flash_attn_func(q, k, v, causal=True, deterministic=flag),
                                   (q, k, v), dout)
    launch.ENABLED = False
    try:
        want = {flag: grads(flag) for flag in (False, True)}
    finally:
        launch.ENABLED = True
    for _ in range(3):
        for flag in (True, False, True):
            for g, w in zip(grads(flag), want[flag]):
                assert torch.equal(g, w)
    torch.use_deterministic_algorithms(True)
    for _ in range(3):
        for g, w in zip(grads(False), want[True]):
            assert torch.equal(g, w)
    # (the call's deterministic=, the path its backward plan was recorded for)
    pairs = {(key[-2], sub[2]) for key, e in api._DENSE.items() for sub in (e.sub or {})}
    assert pairs == {(True, True), (False, False), (False, True)}


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_a_bad_value_is_refused(device, bad):
    q, k, v = _dense(device)
    words = ["deterministic", "bool", type(bad).__name__]
    assert_raises_naming(TypeError, words, triflash.flash_attn_func, q, k, v, deterministic=bad)
    assert_raises_naming(TypeError, words, triflash.attention, q, k, v, deterministic=bad)
    q, k, v, cu = _packed(device)
    assert_raises_naming(TypeError, words, triflash.flash_attn_varlen_func, q, k, v, cu, cu, 23, 23,
                         deterministic=bad)


@pytest.fixture
def chooser(monkeypatch):
    """(deterministic, one_pass) of each call of dispatch.backward_variant (call plans off); packed
    sequences at the tests' head dim 16 ask it too (they ask only at GLUON_PACKED_BACKWARD's head dims)."""
    monkeypatch.setattr(dispatch, "GLUON_PACKED_BACKWARD", frozenset({16}))
    monkeypatch.setattr(launch, "ENABLED", False)
    return record_calls(monkeypatch, dispatch, "backward_variant",
                        lambda args, kwargs: (kwargs["deterministic"], kwargs["one_pass"]))


@pytest.mark.parametrize("case", ["dense", "global switch", "dk dv only", "dq only", "window", "varlen"])
def test_the_one_pass_backward_is_asked_only_where_it_can_run(device, chooser, case):
    """The one-pass backward (dQ by atomics in the dK/dV pass) handles dense calls without a window that
    want all three gradients: the chooser is told so (``one_pass``), and told ``deterministic`` as the
    call and torch's switch say."""
    q, k, v = _dense(device)
    if case == "dk dv only":
        q = q.detach()
    elif case == "dq only":
        k, v = k.detach(), v.detach()
    if case == "global switch":
        torch.use_deterministic_algorithms(True)
    if case == "varlen":
        q, k, v, cu = _packed(device)
        out = triflash.flash_attn_varlen_func(q, k, v, cu, cu, 23, 23, causal=True)
    else:
        out = triflash.flash_attn_func(q, k, v, causal=True, window_size=(8, 0) if case == "window" else (-1, -1))
    out.float().sum().backward()
    one_pass = case in ("dense", "global switch")
    assert chooser == [(case == "global switch", one_pass)]
