"""L2: decode over a paged KV cache (any page size, GQA, empty sequences) against float64, 2x rule."""

import pytest
import torch
from conftest import load_drill
from drill_helpers import FLOOR, assert_close_2x, lse_floor, randn, seeded
from drill_reference import decode_ref

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture(scope="module")
def l2(target):
    return load_drill(target, "l2_paged_decode")


def paged_cache(seqlens, page_size, Hkv, D, dtype, device, seed=0, poison=True):
    """A shuffled pool of pages: sequence b's pages are scattered, unused table entries point at page
    -1 (never to be read), and every slot no sequence owns holds NaN (so reading one shows)."""
    B = len(seqlens)
    pages_per_seq = [-(-n // page_size) for n in seqlens]
    max_pages = max(1, max(pages_per_seq))
    num_pages = sum(pages_per_seq) + 2
    order = torch.randperm(num_pages, generator=seeded(seed))
    table = torch.full((B, max_pages), -1, dtype=torch.int32)
    k = randn(num_pages, page_size, Hkv, D, dtype=dtype, device="cpu", seed=seed + 1)
    v = randn(num_pages, page_size, Hkv, D, dtype=dtype, device="cpu", seed=seed + 2)
    owned = torch.zeros(num_pages, page_size, dtype=torch.bool)
    nxt = 0
    for b, n in enumerate(seqlens):
        for j in range(pages_per_seq[b]):
            page = order[nxt].item()
            nxt += 1
            table[b, j] = page
            owned[page, : min(page_size, n - j * page_size)] = True
    if poison:
        k[~owned], v[~owned] = float("nan"), float("nan")
    return k.to(device), v.to(device), table.to(device), torch.tensor(seqlens, dtype=torch.int32, device=device)


def check(l2, seqlens, page_size, Hq, Hkv, D, dtype, device, block_n=16):
    B = len(seqlens)
    q = randn(B, Hq, D, dtype=dtype, device=device, seed=9)
    k, v, table, lens = paged_cache(seqlens, page_size, Hkv, D, dtype, device)
    o, lse = l2.paged_decode(q, k, v, table, lens, block_n=block_n, return_lse=True)
    # The reference gathers only each sequence's own keys, so the NaN slots never reach it.
    ref, ref_lse = decode_ref(q, k, v, lens, table)
    same, same_lse = decode_ref(q, k, v, lens, table, compute_dtype=None)
    assert o.shape == (B, Hq, D) and o.dtype == dtype and lse.shape == (B, Hq)
    assert_close_2x("out", o, ref, same, FLOOR[dtype])
    assert_close_2x("lse", lse, ref_lse, same_lse, lse_floor(ref_lse))


@pytest.mark.parametrize("page_size", [16, 5, 1, 48], ids=lambda p: f"page{p}")
def test_page_sizes(l2, device, page_size):
    """Pages equal to, smaller than, not dividing, and larger than BLOCK_N = 16."""
    check(l2, [37, 100, 16], page_size, 4, 2, 32, F16, device)


@pytest.mark.parametrize("Hq, Hkv", [(2, 2), (8, 2), (6, 1)], ids=["mha", "gqa4", "mqa6"])
def test_gqa(l2, device, Hq, Hkv):
    """The query heads of a group are the rows of one tile; 6:1 pads 6 rows to 16."""
    check(l2, [50, 21], 8, Hq, Hkv, 16, F16, device)


def test_empty_and_single_key(l2, device):
    """seqlen 0: no key at all, the loop never runs: out 0 and lse -inf, no NaN (0 / 0). seqlen 1: one key."""
    check(l2, [0, 1, 33, 0], 4, 4, 2, 16, F16, device)


def test_bf16(l2, device):
    check(l2, [45, 70], 16, 4, 1, 64, BF16, device)


def test_long_row_max_grows(l2, device):
    """Keys whose scores grow along the sequence, 7 blocks: alpha rescales acc and l every block."""
    B, Hq, Hkv, D, n, page = 1, 2, 1, 16, 110, 16
    q = torch.ones(B, Hq, D, dtype=F16, device=device)
    k, v, table, lens = paged_cache([n], page, Hkv, D, F16, device, poison=False)
    pos = torch.empty(k.shape[:2], dtype=torch.float32)
    for j in range(n):
        pos[table[0, j // page].item(), j % page] = j / 20.0
    k = (pos[:, :, None, None].to(device) + 0.1 * k.float().abs()).to(F16)
    o, lse = l2.paged_decode(q, k, v, table, lens, return_lse=True)
    ref, ref_lse = decode_ref(q, k, v, lens, table)
    same, same_lse = decode_ref(q, k, v, lens, table, compute_dtype=None)
    assert_close_2x("out", o, ref, same, FLOOR[F16])
    assert_close_2x("lse", lse, ref_lse, same_lse, lse_floor(ref_lse))
