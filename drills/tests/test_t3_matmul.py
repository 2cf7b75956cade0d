"""T3: tiled matmul with tl.dot against a float64 product, by the 2x rule."""

import pytest
import torch
from conftest import load_drill
from drill_helpers import FLOOR, assert_close_2x, dtype_id, randn


@pytest.fixture(scope="module")
def t3(target):
    return load_drill(target, "t3_matmul")


def check(t3, a, b, **blocks):
    c = t3.matmul(a, b, **blocks)
    assert c.dtype == a.dtype and c.shape == (a.shape[0], b.shape[1])
    assert_close_2x("c", c, a.double() @ b.double(), (a.float() @ b.float()).to(a.dtype), FLOOR[a.dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("M, N, K", [(32, 32, 16), (64, 48, 80), (33, 47, 71), (1, 5, 3)],
                         ids=lambda v: str(v))
def test_matmul(t3, device, M, N, K, dtype):
    """Sizes that are multiples of the blocks, and ragged ones (masks on rows, columns and K)."""
    check(t3, randn(M, K, dtype=dtype, device=device, seed=M), randn(K, N, dtype=dtype, device=device, seed=N))


def test_transposed_b(t3, device):
    """b = w.T, a view: the kernel reads it through its strides (stride_bk = 1), no copy."""
    a = randn(40, 24, dtype=torch.float16, device=device, seed=1)
    w = randn(36, 24, dtype=torch.float16, device=device, seed=2)
    check(t3, a, w.t())


def test_blocks_differ(t3, device):
    """BLOCK_M != BLOCK_N != BLOCK_K."""
    a = randn(50, 70, dtype=torch.float16, device=device, seed=3)
    b = randn(70, 20, dtype=torch.float16, device=device, seed=4)
    check(t3, a, b, block_m=16, block_n=32, block_k=64)
