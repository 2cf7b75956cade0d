"""T2: online softmax of rows streamed in blocks, and its LSE, against float64, by the 2x rule."""

import pytest
import torch
from conftest import load_drill
from drill_helpers import FLOOR, assert_close_2x, dtype_id, lse_floor, randn


@pytest.fixture(scope="module")
def t2(target):
    return load_drill(target, "t2_online_softmax")


def check(t2, x, block_n=16):
    y, lse = t2.online_softmax(x, block_n=block_n)
    assert y.dtype == x.dtype and lse.dtype == torch.float32
    assert_close_2x("softmax", y, torch.softmax(x.double(), -1), torch.softmax(x, -1), FLOOR[x.dtype])
    ref_lse = torch.logsumexp(x.double(), -1)
    assert_close_2x("lse", lse, ref_lse, torch.logsumexp(x.float(), -1), lse_floor(ref_lse))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("N", [1, 16, 37, 300])
def test_online_softmax(t2, device, N, dtype):
    """Ragged tails (N not a multiple of BLOCK_N) and a single element."""
    check(t2, randn(3, N, dtype=dtype, device=device, seed=N))


def test_row_max_grows(t2, device):
    """Increasing rows: the max grows in every block, so l must be rescaled by alpha every time."""
    x = torch.linspace(-5.0, 20.0, 200, device=device)[None, :].repeat(2, 1)
    x[1] = x[1].flip(0)                    # and the same row with the max in the first block
    check(t2, x)


def test_large_values(t2, device):
    """Values near 200 (exp overflows fp32 at 88.7): the running max keeps every exp <= 1."""
    check(t2, randn(2, 90, dtype=torch.float32, device=device, seed=5) * 30 + 200.0)


def test_one_block_vs_many(t2, device):
    """Block width must not change the answer beyond rounding."""
    x = randn(2, 100, dtype=torch.float32, device=device, seed=6)
    check(t2, x, block_n=128)
    check(t2, x, block_n=16)
