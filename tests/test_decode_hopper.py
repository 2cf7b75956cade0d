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

from triflash.kernels import configs, decode_hopper, launch
from triflash.kernels.common import LOG2E, ScoreVariant
from triflash.kernels.configs import DecodeConfig
from triflash.kernels.dispatch import decode
from triflash.kvcache import flash_attn_with_kvcache

HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon decode kernel runs on sm_90 only")

PAGE_SIZES = [None, 8, 16, 64, 256]               # 8: one swizzle atom per box; 256: pages > BLOCK_N
TILES = [(128, 2), (128, 3), (64, 3), (64, 4)]    # (block_n, K/V ring depth)
QUERIES = [(1, False), (4, True), (4, False)]     # (seqlen_q, causal)
LENGTHS = [0, 1, 17, 151, 1000, 4099]


@pytest.fixture
def gluon_launches(monkeypatch):
    """The keyword arguments of each Gluon decode launch from here on (the kernel still runs)."""
    calls = []
    real = decode_hopper.decode_hopper
    monkeypatch.setattr(decode_hopper, "decode_hopper", lambda *a, **k: calls.append(k) or real(*a, **k))
    return calls


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


# (name, window_size, causal, seqlen_q, (Hq, Hkv), score variants): windows of each kind (left only,
# causal with a left edge, both edges, right only), each score variant ("alibi": [B, Hq] slopes,
# "alibi_heads": [Hq]), and all of them under a window. Heads: GROUP 1, 4, and 16 with 5 queries
# (80 packed rows: a second row block).
VARIANT_CASES = [
    ("left300-Sq1", (300, -1), False, 1, (4, 4), ()),
    ("left40-causal-Sq4", (40, 0), True, 4, (8, 2), ()),
    ("left30-right3-Sq5", (30, 3), False, 5, (32, 2), ()),
    ("right2-Sq4", (-1, 2), False, 4, (8, 2), ()),
    ("softcap-Sq1", (-1, -1), False, 1, (8, 2), ("softcap",)),
    ("alibi-causal-Sq4", (-1, -1), True, 4, (8, 2), ("alibi",)),
    ("alibi_heads-full-Sq5", (-1, -1), False, 5, (32, 2), ("alibi_heads",)),
    ("sinks-Sq1", (-1, -1), False, 1, (4, 4), ("sinks",)),
    ("all-left200-causal-Sq5", (200, 0), True, 5, (32, 2), ("softcap", "alibi", "sinks")),
]


def _variant_kwargs(names, batch, heads_q, device):
    """Score variants by name: softcap 5, ALiBi slopes [B, Hq] ("alibi") or [Hq] ("alibi_heads"),
    sinks [Hq]."""
    kwargs = {}
    if "softcap" in names:
        kwargs["softcap"] = 5.0
    if "alibi" in names:
        kwargs["alibi_slopes"] = torch.rand(batch, heads_q, device=device) * 0.5
    if "alibi_heads" in names:
        kwargs["alibi_slopes"] = torch.rand(heads_q, device=device) * 0.5
    if "sinks" in names:
        kwargs["sinks"] = torch.randn(heads_q, device=device) * 2
    return kwargs


def _variant_cases():
    """Every case at both head dims, with one split (the sink in the kernel, the final output written
    directly) and three (the merge), over a contiguous and a paged cache; the two dtypes in turn."""
    grid = itertools.product(VARIANT_CASES, (64, 128), (1, 3), (None, 16))
    for i, ((name, window, causal, seqlen_q, heads, names), head_dim, splits, page_size) in enumerate(grid):
        dtype = (torch.float16, torch.bfloat16)[i // 3 % 2]
        cid = f"{name}-H{heads[0]}-{heads[1]}-{_page_id(page_size)}-D{head_dim}-{DTYPE_ID[dtype]}-splits{splits}"
        yield pytest.param(window, causal, seqlen_q, heads, names, page_size, head_dim, dtype, splits, id=cid)


@needs_hopper
@pytest.mark.parametrize("window,causal,seqlen_q,heads,names,page_size,head_dim,dtype,splits", list(_variant_cases()))
def test_gluon_decode_with_windows_and_score_variants(device, window, causal, seqlen_q, heads, names, page_size,
                                                      head_dim, dtype, splits):
    """Local windows and softcap / ALiBi / sinks in the Gluon kernel, against the float64 reference,
    the slots past each length NaN; one split (the sink in the kernel) and three (in the merge). A
    sequence of length 0 gets out 0 and lse -inf, or with sinks its head's sink (to the last bits:
    the kernel takes the sink into the scores' units and back)."""
    hq, hkv = heads
    lengths = torch.tensor(LENGTHS, dtype=torch.int32, device=device)[torch.randperm(len(LENGTHS))]
    batch = len(LENGTHS)
    k_cache, v_cache, block_table = make_cache(batch, max(LENGTHS) + 7, hkv, head_dim, dtype, device, page_size)
    poison_past_lengths(k_cache, lengths, block_table)
    poison_past_lengths(v_cache, lengths, block_table)
    q = torch.randn(batch, seqlen_q, hq, head_dim, dtype=dtype, device=device)
    variants = _variant_kwargs(names, batch, hq, device)
    config = DecodeConfig(64, 128, 4, 2, splits, kernel="gluon")
    out, lse = decode(q, k_cache, v_cache, lengths, block_table, 0, max(LENGTHS), head_dim ** -0.5, causal,
                      config=config, window=window, scores=ScoreVariant(**variants))
    check_against_references(out, lse, q, k_cache, v_cache, lengths, block_table, causal, dtype,
                             window_size=window, **variants)
    empty = lengths == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    if "sinks" in names:
        expected = variants["sinks"][None, :, None].expand(int(empty.sum()), hq, seqlen_q)
        torch.testing.assert_close(lse[empty], expected, rtol=2.0 ** -22, atol=0.0)
    else:
        assert torch.isneginf(lse[empty]).all()


@needs_hopper
@pytest.mark.parametrize("switched_on", [False, True], ids=["off", "on"])
def test_decode_variants_take_gluon_only_when_switched_on(device, monkeypatch, gluon_launches, switched_on):
    """Where the chooser takes the Gluon kernel (batch 1, from 8k keys, D=128; the window holds 9001
    keys), a call with a window or a score variant goes to it only with
    ``dispatch.GLUON_DECODE_VARIANTS`` on, and is right either way."""
    from triflash.kernels import dispatch

    monkeypatch.setattr(dispatch, "GLUON_DECODE_VARIANTS", switched_on)
    k_cache, v_cache, _ = make_cache(1, 16384, 8, 128, torch.float16, device, None)
    seqlens = torch.tensor([16384], dtype=torch.int32, device=device)
    q = torch.randn(1, 1, 32, 128, dtype=torch.float16, device=device)
    sinks = torch.randn(32, device=device)
    for kwargs in (dict(sinks=sinks), dict(window_size=(9000, 0))):
        gluon_launches.clear()
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, return_lse=True, **kwargs)
        assert len(gluon_launches) == int(switched_on)
        window = kwargs.pop("window_size", (-1, -1))
        check_against_references(out, lse, q, k_cache, v_cache, seqlens, None, False, torch.float16,
                                 window_size=window, **kwargs)


def test_gluon_decode_launch_takes_windows_and_score_variants(monkeypatch):
    """The Gluon decode's host side, on any machine (launch.run records instead of launching): a forced
    Gluon config gets the call's window (as ``window_bounds`` resolves it) and score variants, softcap
    in natural units (epilogue scale 1, softmax scale log2 e), ALiBi alone in raw units (its slopes
    times 1 / scale), and the sinks in the kernel only with one split: with several the merge adds
    them, once."""
    calls = []
    monkeypatch.setattr(launch, "run", lambda kernel, grid, **kw: calls.append((kernel.fn.__name__, kw)))
    monkeypatch.setattr(decode_hopper, "supported", lambda *args: True)
    batch, hq, hkv, scale = 2, 8, 2, 0.125
    q = torch.randn(batch, 4, hq, 64, dtype=torch.float16)
    k_cache, v_cache, block_table = make_cache(batch, 256, hkv, 64, torch.float16, "cpu", 16)
    lengths = torch.tensor([100, 250], dtype=torch.int32)
    slopes, sinks = torch.rand(hq), torch.randn(hq)
    cases = ((1, 0.0, True, (40, -1), (40, 0)), (3, 5.0, False, (30, 2), (30, 2)), (1, 5.0, True, (-1, -1), None))
    for splits, softcap, causal, window, bounds in cases:
        calls.clear()
        decode(q, k_cache, v_cache, lengths, block_table, 0, 256, scale, causal,
               config=DecodeConfig(64, 128, 4, 2, splits, kernel="gluon"), window=window,
               scores=ScoreVariant(softcap, slopes, sinks))
        name, kw = calls[0]
        assert name == "_decode_hopper_kernel"
        if bounds is None:                 # causal, no left edge: the plain causal kernel
            assert (kw["HAS_LEFT"], kw["HAS_RIGHT"], kw["IS_CAUSAL"]) == (False, False, True)
        else:
            assert (kw["window_left"], kw["window_right"], kw["HAS_LEFT"], kw["HAS_RIGHT"]) == (*bounds, True, True)
        assert kw["ALIBI"] and kw["ALIBI_SLOPES"] is slopes and (kw["stride_ab"], kw["stride_ah"]) == (0, 1)
        if softcap:
            assert kw["SOFTCAP"] and kw["softcap"] == softcap and kw["tanh_scale"] == scale / softcap
            assert (kw["sm_scale"], kw["qk_scale"], kw["slope_scale"]) == (1.0, LOG2E, None)
        else:
            assert not kw["SOFTCAP"] and (kw["sm_scale"], kw["qk_scale"]) == (scale, scale * LOG2E)
            assert kw["slope_scale"] == 1 / scale
        assert kw["HAS_SINKS"] == (splits == 1) and (kw["SINKS"] is sinks) == (splits == 1)
        merges = [kw for name, kw in calls[1:]]
        assert len(merges) == (splits > 1) and all(m["HAS_SINKS"] and m["SINKS"] is sinks for m in merges)


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
def test_decode_takes_gluon_at_batch_one(device, gluon_launches, page_size):
    """flash_attn_with_kvcache at batch 1 and 8k keys (D=128) runs the Gluon kernel, correctly."""
    k_cache, v_cache, block_table = make_cache(1, 8192, 8, 128, torch.float16, device, page_size)
    seqlens = torch.tensor([8192], dtype=torch.int32, device=device)
    q = torch.randn(1, 1, 32, 128, dtype=torch.float16, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table,
                                       return_lse=True)
    assert len(gluon_launches) == 1 and gluon_launches[0]["num_splits"] == 16
    check_against_references(out, lse, q, k_cache, v_cache, seqlens, block_table, False, torch.float16)
