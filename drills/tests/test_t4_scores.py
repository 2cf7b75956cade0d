"""T4: attention scores q @ k^T * scale on [B, H, S, D], K read transposed, against float64."""

import pytest
import torch
from conftest import load_drill
from drill_helpers import assert_close_2x, dtype_id, randn


@pytest.fixture(scope="module")
def t4(target):
    return load_drill(target, "t4_scores")


def check(t4, q, k, scale=None, **blocks):
    s = t4.scores(q, k, sm_scale=scale, **blocks)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ref = q.double() @ k.double().transpose(-1, -2) * scale
    same = (q @ k.transpose(-1, -2)).float() * scale
    assert s.dtype == torch.float32
    assert_close_2x("scores", s, ref, same, 2.0**-16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("B, H, Sq, Sk, D", [(2, 3, 32, 32, 16), (1, 2, 17, 45, 32), (1, 1, 1, 70, 64)],
                         ids=lambda v: str(v))
def test_scores(t4, device, B, H, Sq, Sk, D, dtype):
    """Ragged Sq and Sk (tails masked on both axes), several heads (the int64 base offset per head)."""
    q = randn(B, H, Sq, D, dtype=dtype, device=device, seed=1)
    k = randn(B, H, Sk, D, dtype=dtype, device=device, seed=2)
    check(t4, q, k)


def test_bshd_views(t4, device):
    """[B, S, H, D] memory seen as [B, H, S, D]: strides, not copies."""
    q = randn(2, 20, 3, 16, dtype=torch.float16, device=device, seed=3).transpose(1, 2)
    k = randn(2, 24, 3, 16, dtype=torch.float16, device=device, seed=4).transpose(1, 2)
    check(t4, q, k, scale=0.3, block_m=16, block_n=16)
