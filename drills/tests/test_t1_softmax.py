"""T1: fused row softmax against float64 softmax, by the 2x rule."""

import pytest
import torch
from conftest import load_drill
from drill_helpers import FLOOR, assert_close_2x, dtype_id, randn

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def t1(target):
    return load_drill(target, "t1_softmax")


def check(t1, x):
    y = t1.softmax(x)
    assert y.dtype == x.dtype
    ref = torch.softmax(x.double(), dim=-1)
    same = torch.softmax(x, dim=-1)
    assert_close_2x("softmax", y, ref, same, FLOOR[x.dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("M, N", [(1, 1), (4, 17), (3, 128), (5, 1000)], ids=lambda v: str(v))
def test_softmax(t1, device, M, N, dtype):
    """Odd N: lanes past N must be -inf (not 0) before the max and the sum."""
    check(t1, randn(M, N, dtype=dtype, device=device, seed=N))


def test_large_values(t1, device):
    """Scores near 100: exp(100) overflows fp32; subtracting the row max first is what saves it."""
    x = randn(4, 64, dtype=torch.float32, device=device, seed=1) + 100.0
    check(t1, x)


def test_negative_row(t1, device):
    """All entries negative: padding lanes loaded as 0 instead of -inf would win the max."""
    x = -randn(3, 33, dtype=torch.float16, device=device, seed=2).abs() - 4.0
    check(t1, x)


def test_row_stride(t1, device):
    """A view whose rows are further apart than N (every other column dropped): the row stride is used."""
    x = randn(6, 80, dtype=torch.float16, device=device, seed=3)[:, :50]
    check(t1, x)
