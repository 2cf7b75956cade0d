"""L3: the LSE merge kernel, and split-KV decode (partials + merge), against float64, 2x rule."""

import pytest
import torch
from conftest import load_drill
from drill_helpers import FLOOR, assert_close_2x, lse_floor, randn
from drill_reference import decode_ref

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture(scope="module")
def l3(target):
    return load_drill(target, "l3_split_merge")


def merge_ref(o_part, lse_part, dtype):
    """The merge in ``dtype`` (float64: the truth; float32: PyTorch at the partials' precision)."""
    lse = torch.logsumexp(lse_part.to(dtype), dim=0)                      # [R]
    w = torch.exp(lse_part.to(dtype) - torch.where(torch.isneginf(lse), 0.0, lse))   # [N, R]
    o = (w[..., None] * torch.where(w[..., None] > 0, o_part.to(dtype), 0.0)).sum(0)
    return o, lse


def check_merge(l3, o_part, lse_part):
    o, lse = l3.merge_states(o_part, lse_part)
    ref, ref_lse = merge_ref(o_part, lse_part, torch.float64)
    same, same_lse = merge_ref(o_part, lse_part, torch.float32)
    assert_close_2x("out", o, ref, same, FLOOR[torch.float32])
    assert_close_2x("lse", lse, ref_lse, same_lse, lse_floor(ref_lse))


@pytest.mark.parametrize("N", [1, 3, 8])
def test_merge(l3, device, N):
    """Random partials; N = 3 pads the split lanes to 4 (masked as -inf)."""
    o_part = randn(N, 2, 5, 32, dtype=torch.float32, device=device, seed=N)
    lse_part = randn(N, 2, 5, dtype=torch.float32, device=device, seed=N + 10) * 3
    check_merge(l3, o_part, lse_part)


def test_merge_empty_partials(l3, device):
    """lse_n = -inf: weight 0 and its o_n never read (it holds NaN here); a row whose every partial is
    empty gives out 0, lse -inf."""
    o_part = randn(4, 6, 16, dtype=torch.float32, device=device, seed=1)
    lse_part = randn(4, 6, dtype=torch.float32, device=device, seed=2)
    lse_part[1, :] = float("-inf")
    lse_part[:, 3] = float("-inf")
    o_part[1] = float("nan")
    o_part[:, 3] = float("nan")
    check_merge(l3, o_part, lse_part)
    o, lse = l3.merge_states(o_part, lse_part)
    assert torch.all(o[3] == 0) and torch.isneginf(lse[3])


def test_merge_far_apart(l3, device):
    """LSEs of 150 and -150: exp(lse) overflows fp32; merging around the max does not."""
    o_part = randn(3, 4, 16, dtype=torch.float32, device=device, seed=3)
    lse_part = torch.tensor([[150.0] * 4, [-150.0] * 4, [149.0] * 4], device=device)
    check_merge(l3, o_part, lse_part)


def contiguous_cache(seqlens, Hkv, D, dtype, device, s_max=None):
    B = len(seqlens)
    s_max = s_max or max(max(seqlens), 1)
    k = randn(B, s_max, Hkv, D, dtype=dtype, device=device, seed=4)
    v = randn(B, s_max, Hkv, D, dtype=dtype, device=device, seed=5)
    return k, v, torch.tensor(seqlens, dtype=torch.int32, device=device)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_split_kv_decode(l3, device, num_splits, dtype):
    """End to end: partials + merge = attention over every key. Sequence lengths 0, 5 and 90 in a cache of
    96 slots: with 8 splits of 16 keys, the short sequences leave most splits empty (lse_n = -inf)."""
    Hq, Hkv, D = 4, 2, 32
    k, v, lens = contiguous_cache([90, 5, 0], Hkv, D, dtype, device, s_max=96)
    q = randn(3, Hq, D, dtype=dtype, device=device, seed=6)
    o, lse = l3.split_kv_decode(q, k, v, lens, num_splits=num_splits)
    ref, ref_lse = decode_ref(q, k, v, lens)
    same, same_lse = decode_ref(q, k, v, lens, compute_dtype=None)
    assert o.dtype == dtype
    assert_close_2x("out", o, ref, same, FLOOR[dtype])
    assert_close_2x("lse", lse, ref_lse, same_lse, lse_floor(ref_lse))


def test_partials_are_partial(l3, device):
    """Each partial alone is attention over its own chunk of keys (what the merge relies on)."""
    Hq, Hkv, D = 2, 1, 16
    k, v, lens = contiguous_cache([40], Hkv, D, F16, device)
    q = randn(1, Hq, D, dtype=F16, device=device, seed=7)
    o_part, lse_part = l3.split_kv_partials(q, k, v, lens, num_splits=3)
    assert o_part.shape == (3, 1, Hq, D) and lse_part.shape == (3, 1, Hq)
    # 3 splits of 40 keys with BLOCK_N = 16: chunks [0, 16), [16, 32), [32, 40)
    for n, (lo, hi) in enumerate([(0, 16), (16, 32), (32, 40)]):
        chunk = torch.tensor([hi - lo], dtype=torch.int32)
        ref, ref_lse = decode_ref(q, k[:, lo:hi], v[:, lo:hi], chunk)
        same, same_lse = decode_ref(q, k[:, lo:hi], v[:, lo:hi], chunk, compute_dtype=None)
        assert_close_2x(f"out[{n}]", o_part[n], ref, same, FLOOR[F16])
        assert_close_2x(f"lse[{n}]", lse_part[n], ref_lse, same_lse, lse_floor(ref_lse))
