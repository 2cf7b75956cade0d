"""The tolerance rule of the drill tests, and small input makers.

The "2x rule" (FlashAttention's test suite and triflash's tests/helpers.py use the same idea): compute the
result in float64 (the truth) and in PyTorch at the input dtype; the kernel's max error against the truth
may be at most twice PyTorch's own max error, plus a small absolute floor (which only matters where
PyTorch happens to be exact, a single key for instance). Gradients get 3x: they pass through two more
roundings of p and dS to the input dtype than PyTorch's autograd does.

One interpreter allowance: Triton's CPU interpreter converts fp32 to bf16 by truncation (round toward
zero; the GPU rounds to nearest), so a correct kernel's bf16 output can be one bf16 ulp off instead of
half an ulp. In the interpreter only, bf16 results get one ulp of the largest reference value (2^-7
relative) added to the floor. On a GPU there is no allowance.
"""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FLOOR = {torch.float16: 2.0**-12, torch.bfloat16: 2.0**-9, torch.float32: 2.0**-20}
LSE_FLOOR = 2.0**-16


def max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| over the finite entries of ref; where ref is +-inf, got must equal it."""
    got, ref = got.double(), ref.double()
    inf = torch.isinf(ref)
    if inf.any():
        assert torch.equal(got[inf], ref[inf]), "infinite reference entries (empty rows) not reproduced"
    if (~inf).sum() == 0:
        return 0.0
    return (got[~inf] - ref[~inf]).abs().max().item()


def assert_close_2x(name: str, got, ref64, same_dtype, floor: float, factor: float = 2.0) -> None:
    """got's error vs ref64 <= factor x same_dtype's error vs ref64 + floor; and no NaN in got."""
    assert got.shape == ref64.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(ref64.shape)}"
    nan = torch.isnan(got)
    assert not nan.any(), f"{name}: {nan.sum().item()} of {got.numel()} elements are NaN"
    err, base = max_err(got, ref64), max_err(same_dtype, ref64)
    if INTERPRET and got.dtype == torch.bfloat16:
        floor += 2.0**-7 * ref64[torch.isfinite(ref64)].abs().max().item() if ref64.numel() else 0.0
    assert err <= factor * base + floor, (
        f"{name}: max error {err:.3e} > {factor:g} x PyTorch same-dtype error {base:.3e} + floor {floor:.1e}")


def lse_floor(ref_lse: torch.Tensor) -> float:
    """LSE rounding grows with its size: a floor relative to max(1, max |lse|)."""
    finite = ref_lse[torch.isfinite(ref_lse)]
    return LSE_FLOOR * max(1.0, finite.abs().max().item() if finite.numel() else 0.0)


def dtype_id(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype, device, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Normal numbers made on the CPU from a fixed seed (same values on every device), then moved."""
    return (torch.randn(*shape, generator=seeded(seed), dtype=torch.float32) * scale).to(dtype).to(device)
