"""The Gluon decode kernel (kernels/decode_hopper.py), forced through DecodeConfig(kernel="gluon").

On an H200 every case is checked against the float64 reference (the 2x rule of helpers.py), with the
cache slots past each sequence's length filled with NaN: the kernel's TMA boxes read whole pages and
key blocks, so this is what shows that those bytes never reach the result. On the CPU only the
argument checks run (Gluon kernels do not run in the interpreter).
"""

import itertools

import pytest
import torch
from conftest import ON_GPU
from helpers import DTYPE_ID, assert_raises_naming
from test_decode import HEADS, HEADS_ID, _page_id, check_against_references, make_cache

from triflash.kernels import configs, decode_hopper
from triflash.kernels.configs import DecodeConfig
from triflash.kernels.dispatch import decode
from triflash.kvcache import flash_attn_with_kvcache

HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon decode kernel runs on sm_90 only")

PAGE_SIZES = [None, 8, 16, 64, 256]               # 8: one swizzle atom per box; 256: pages > BLOCK_N
TILES = [(128, 2), (128, 3), (64, 3), (64, 4)]    # (block_n, K/V ring depth)
QUERIES = [(1, False), (4, True), (4, False)]     # (seqlen_q, causal)
LENGTHS = [0, 1, 17, 151, 1000, 4099]


def poison_past_lengths(cache, lengths, block_table):
    """NaN in every cache slot that holds no key of any sequence (past each length, spare pages)."""
    if block_table is None:
        keys = torch.arange(cache.shape[1], device=cache.device)
        cache[keys[None, :] >= lengths[:, None].long()] = float("nan")
        return
    page_size = cache.shape[1]
    live = torch.zeros(cache.shape[:2], dtype=torch.bool, device=cache.device)
    for b, length in enumerate(lengths.tolist()):
        keys = torch.arange(length, device=cache.device)
        live[block_table[b, keys // page_size].long(), keys % page_size] = True
    cache[~live] = float("nan")


def _cases():
    grid = itertools.product(PAGE_SIZES, (64, 128), (torch.float16, torch.bfloat16), QUERIES, (1, 3))
    for i, (page_size, head_dim, dtype, (seqlen_q, causal), splits) in enumerate(grid):
        heads = HEADS[i % len(HEADS)]
        tile = TILES[i % len(TILES)]
        cid = (f"{_page_id(page_size)}-D{head_dim}-{DTYPE_ID[dtype]}-Sq{seqlen_q}-"
               f"{'causal' if causal else 'full'}-splits{splits}-{HEADS_ID[heads]}-N{tile[0]}s{tile[1]}")
        yield pytest.param(page_size, head_dim, dtype, seqlen_q, causal, splits, heads, tile, id=cid)


@needs_hopper
@pytest.mark.parametrize("page_size,head_dim,dtype,seqlen_q,causal,splits,heads,tile", list(_cases()))
def test_gluon_decode_matches_references(device, page_size, head_dim, dtype, seqlen_q, causal, splits,
                                        heads, tile):
    hq, hkv = heads
    lengths = torch.tensor(LENGTHS, dtype=torch.int32, device=device)[torch.randperm(len(LENGTHS))]
    batch = len(LENGTHS)
    k_cache, v_cache, block_table = make_cache(batch, max(LENGTHS) + 7, hkv, head_dim, dtype, device,
                                               page_size)
    poison_past_lengths(k_cache, lengths, block_table)
    poison_past_lengths(v_cache, lengths, block_table)
    q = torch.randn(batch, seqlen_q, hq, head_dim, dtype=dtype, device=device)
    config = DecodeConfig(64, tile[0], 4, tile[1], splits, kernel="gluon")
    out, lse = decode(q, k_cache, v_cache, lengths, None if block_table is None else block_table, 0,
                      max(LENGTHS), head_dim ** -0.5, causal, config=config)
    check_against_references(out, lse, q, k_cache, v_cache, lengths, block_table, causal, dtype)
    empty = lengths == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.isneginf(lse[empty]).all()


@needs_hopper
@pytest.mark.parametrize("page_size", [None, 16], ids=_page_id)
@pytest.mark.parametrize("lengths", [[131072], [65537, 8191, 0, 131071]], ids=["B1-128k", "B4-mixed"])
def test_gluon_decode_long_context(device, page_size, lengths):
    hq, hkv, head_dim, dtype = 32, 8, 128, torch.float16
    k_cache, v_cache, block_table = make_cache(len(lengths), max(lengths), hkv, head_dim, dtype, device,
                                               page_size)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    q = torch.randn(len(lengths), 1, hq, head_dim, dtype=dtype, device=device)
    config = DecodeConfig(64, 128, 4, 2, 16, kernel="gluon")
    out, lse = decode(q, k_cache, v_cache, seqlens, block_table, 0, max(lengths), head_dim ** -0.5,
                      False, config=config)
    check_against_references(out, lse, q, k_cache, v_cache, seqlens, block_table, False, dtype)


def test_gluon_config_is_checked():
    with pytest.raises(ValueError, match="kernel must be 'triton' or 'gluon'.*'cuda'"):
        DecodeConfig(64, 128, 4, 2, kernel="cuda")
    with pytest.raises(ValueError, match="block_m=64 and num_warps=4.*block_m=16, num_warps=4"):
        DecodeConfig(16, 128, 4, 2, kernel="gluon")


@pytest.mark.parametrize("what", ["fp32", "head_dim", "page_size"])
def test_gluon_decode_refuses_what_it_does_not_handle(device, what):
    """Inputs outside decode_hopper.supported raise a ValueError naming the kernel, never run it."""
    dtype = torch.float32 if what == "fp32" else torch.float16
    head_dim = 96 if what == "head_dim" else 64
    page_size = 4 if what == "page_size" else 16
    k_cache, v_cache, block_table = make_cache(2, 64, 2, head_dim, dtype, device, page_size)
    q = torch.randn(2, 1, 4, head_dim, dtype=dtype, device=device)
    lengths = torch.tensor([5, 64], dtype=torch.int32, device=device)
    assert not decode_hopper.supported(q, k_cache, v_cache, block_table)
    assert_raises_naming(ValueError, ["kernel='gluon'", "head_dim 64 or 128", str(tuple(q.shape))],
                         decode, q, k_cache, v_cache, lengths, block_table, 0, 64, 0.125, False,
                         config=DecodeConfig(64, 128, 4, 2, kernel="gluon"))


def test_chooser_takes_gluon_where_measured(monkeypatch):
    """decode_config takes the Gluon kernel only where run 70 measured it faster: head_dim 128, fewer
    programs than a quarter of the SMs, from GLUON_DECODE_MIN_KEYS keys, and only when the inputs
    suit it (``gluon_suits``, asked only for such shapes). Its split count fills one wave of one
    program per SM."""
    monkeypatch.setattr(configs, "INTERPRET", False)
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    asked = []

    def suits(answer):
        return lambda: asked.append(answer) or answer

    common = dict(head_dim=128, dtype=torch.float16, rows=4, heads_kv=8, paged=True, device="cpu",
                  page_size=16, num_splits=0)

    def kernel(**kw):
        return configs.decode_config(**dict(common, **kw)).kernel

    cfg = configs.decode_config(batch=1, max_seqlen=131072, gluon_suits=suits(True), **common)
    assert (cfg.kernel, cfg.block_m, cfg.block_n, cfg.num_stages, cfg.num_splits) == ("gluon", 64, 128, 2, 16)
    assert kernel(batch=4, max_seqlen=32768, gluon_suits=suits(True)) == "gluon"
    assert kernel(batch=1, max_seqlen=131072, gluon_suits=suits(False)) == "triton"
    assert kernel(batch=1, max_seqlen=131072, gluon_suits=None) == "triton"
    assert asked == [True, True, False]
    # Shapes the rule leaves to the Triton kernel never ask whether the inputs suit.
    for kw in (dict(batch=1, max_seqlen=4096), dict(batch=5, max_seqlen=32768),
               dict(batch=16, max_seqlen=8192), dict(batch=1, max_seqlen=131072, head_dim=64)):
        assert kernel(gluon_suits=suits(True), **kw) == "triton", kw
    assert asked == [True, True, False]
    fixed = configs.decode_config(batch=1, max_seqlen=131072, gluon_suits=suits(True),
                                  **dict(common, num_splits=3))
    assert (fixed.kernel, fixed.num_splits) == ("gluon", 3)


@needs_hopper
@pytest.mark.parametrize("page_size", [None, 16], ids=_page_id)
def test_decode_takes_gluon_at_batch_one(device, monkeypatch, page_size):
    """flash_attn_with_kvcache at batch 1 and 8k keys (D=128) runs the Gluon kernel, correctly."""
    calls = []
    launch = decode_hopper.decode_hopper
    monkeypatch.setattr(decode_hopper, "decode_hopper", lambda *a, **k: calls.append(k) or launch(*a, **k))
    k_cache, v_cache, block_table = make_cache(1, 8192, 8, 128, torch.float16, device, page_size)
    seqlens = torch.tensor([8192], dtype=torch.int32, device=device)
    q = torch.randn(1, 1, 32, 128, dtype=torch.float16, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table,
                                       return_lse=True)
    assert len(calls) == 1 and calls[0]["num_splits"] == 16
    check_against_references(out, lse, q, k_cache, v_cache, seqlens, block_table, False, torch.float16)
