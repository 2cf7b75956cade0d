"""The oldest Triton the package accepts (pyproject: triton>=3.4) runs every path: where its Gluon API is
too old for the Hopper kernels, calls fall back to the portable Triton kernels with one warning. CI runs
this file and a forward subset again after installing that oldest Triton."""

import warnings

import torch
import triton

import triflash
from triflash.kernels import configs


def _version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def test_gluon_kernels_import_or_fall_back_with_one_warning():
    configs.gluon_available.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, second = configs.gluon_available(), configs.gluon_available()
    finally:
        configs.gluon_available.cache_clear()
    assert first == second
    if _version() >= (3, 5):
        assert first and not caught
    else:
        assert not first and len(caught) == 1
        assert "portable Triton kernels" in str(caught[0].message) and triton.__version__ in str(caught[0].message)


def test_forward_and_backward_run_on_this_triton(device):
    q, k, v = (torch.randn(1, 40, 2, 32, dtype=torch.float16, device=device, requires_grad=True) for _ in range(3))
    out = triflash.flash_attn_func(q, k, v, causal=True)
    torch.autograd.grad(out.float().sum(), (q, k, v))
    assert out.shape == q.shape and torch.isfinite(out).all()
