"""flash_attn_with_kvcache: paged and contiguous caches, split-KV, append, validation.

Every result is checked against ``kvcache_ref`` (float64, the 2x rule of helpers.py); appends are
also checked slot by slot in the cache itself. On the CPU the grid rotates dtype,
head grouping and head dim across (cache layout x num_splits x query shape); on a GPU the full
product runs, with bf16 and longer sequences.
"""

import itertools

import pytest
import torch
import triton
from conftest import DTYPES, ON_GPU
from helpers import DTYPE_ID, LSE_FLOOR, assert_2x_rule, assert_no_nan, assert_raises_naming, make_qkv

import triflash.kvcache as kvcache
from triflash.kernels import configs
from triflash.kernels.configs import DecodeConfig
from triflash.kernels.dispatch import decode
from triflash.kvcache import flash_attn_with_kvcache
from triflash.reference import kvcache_ref

# None: contiguous [B, S_max, Hkv, D] cache. 1 and 16 tile a key block with whole pages (one
# block-table read per page); 5 does not (one read per key); 256 holds whole key blocks.
PAGE_SIZES = [None, 1, 5, 16, 256]
HEADS = [(16, 2), (8, 1), (2, 2)]                  # GQA 8:1, MQA 8:1, MHA
HEADS_ID = {(16, 2): "gqa8", (8, 1): "mqa8", (2, 2): "mha"}
HEAD_DIMS = [40, 64, 128] + ([72, 256] if ON_GPU else [])
QUERIES = [(1, False), (4, True), (4, False)]      # (seqlen_q, causal)
SPLITS = [1, 3, 0]
# Lengths per sequence (cached keys before any append): empty, one key, odd sizes. The longest is
# long enough for num_splits=0 to choose more than one split (checked in the test).
LENGTHS = [0, 1, 17, 151] + ([1000, 4099] if ON_GPU else [])


def _page_id(page_size):
    return "contig" if page_size is None else f"page{page_size}"


def make_cache(batch, capacity, heads_kv, head_dim, dtype, device, page_size, spare_pages=5,
               packed=False):
    """(k_cache, v_cache, block_table) able to hold ``capacity`` keys per sequence.

    Paged: the pages of all sequences are drawn, shuffled, from a pool larger than needed
    (torch.randperm), so a sequence's pages are neither contiguous nor in order. packed=True makes
    k_cache and v_cache strided views of one [.., 2, Hkv, D] tensor (not contiguous)."""
    if page_size is None:
        shape, block_table = (batch, capacity), None
    else:
        max_pages = -(-capacity // page_size)
        num_pages = batch * max_pages + spare_pages
        perm = torch.randperm(num_pages, device=device)[:batch * max_pages]
        block_table = perm.reshape(batch, max_pages).to(torch.int32)
        shape = (num_pages, page_size)
    if packed:
        kv = torch.randn(*shape, 2, heads_kv, head_dim, dtype=dtype, device=device)
        return kv[:, :, 0], kv[:, :, 1], block_table
    k_cache = torch.randn(*shape, heads_kv, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn(*shape, heads_kv, head_dim, dtype=dtype, device=device)
    return k_cache, v_cache, block_table


def check_against_references(out, lse, q, k_cache, v_cache, cache_seqlens, block_table, causal,
                             dtype, k=None, v=None, softmax_scale=None, window_size=(-1, -1), **variants):
    """out/lse vs the float64 reference (2x rule). k_cache/v_cache are the caches *before* the call
    (the reference appends k/v itself). ``variants``: softcap, alibi_slopes, sinks."""
    kwargs = dict(k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table,
                  softmax_scale=softmax_scale, causal=causal, return_lse=True, window_size=window_size, **variants)
    ref, ref_lse = kvcache_ref(q, k_cache, v_cache, **kwargs)
    same, same_lse = kvcache_ref(q, k_cache, v_cache, compute_dtype=None, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert_no_nan("lse", lse)
    assert_2x_rule("out", out, ref, same, dtype)
    assert_2x_rule("lse", lse, ref_lse, same_lse, dtype, LSE_FLOOR, relative_floor=True)



def _cases():
    cases = []
    grid = itertools.product(enumerate(PAGE_SIZES), enumerate(SPLITS), enumerate(QUERIES))
    for (pi, page_size), (si, splits), (qi, (seqlen_q, causal)) in grid:
        if ON_GPU:
            # Every dtype and head grouping; head dims rotate (each is a separate compilation).
            d = HEAD_DIMS[(pi + si + qi) % len(HEAD_DIMS)]
            combos = [(dtype, heads, d) for dtype, heads in itertools.product(DTYPES, HEADS)]
        else:
            # Rotate so that each dtype, head grouping and head dim meets every cache layout, split
            # count and query shape.
            combos = [(DTYPES[(pi + si + qi) % len(DTYPES)], HEADS[(pi + 2 * si + qi) % len(HEADS)],
                       HEAD_DIMS[(2 * pi + si + qi) % len(HEAD_DIMS)])]
        for dtype, heads, head_dim in combos:
            cid = (f"{_page_id(page_size)}-splits{splits}-Sq{seqlen_q}-{'causal' if causal else 'full'}"
                   f"-D{head_dim}-{DTYPE_ID[dtype]}-{HEADS_ID[heads]}")
            cases.append(pytest.param(page_size, splits, seqlen_q, causal, dtype, heads, head_dim,
                                      id=cid))
    return cases


@pytest.mark.parametrize("page_size,num_splits,seqlen_q,causal,dtype,heads,head_dim", _cases())
def test_decode_matches_references(device, page_size, num_splits, seqlen_q, causal, dtype, heads,
                                   head_dim):
    hq, hkv = heads
    lengths = torch.tensor(LENGTHS, dtype=torch.int32, device=device)[torch.randperm(len(LENGTHS))]
    batch = len(LENGTHS)
    capacity = max(LENGTHS) + 7
    k_cache, v_cache, block_table = make_cache(batch, capacity, hkv, head_dim, dtype, device, page_size)
    q = torch.randn(batch, seqlen_q, hq, head_dim, dtype=dtype, device=device)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                       block_table=block_table, causal=causal,
                                       num_splits=num_splits, return_lse=True)

    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before), "cache modified"
    if num_splits == 0:
        chosen = configs.decode_config(head_dim=head_dim, dtype=dtype, rows=hq // hkv * seqlen_q,
                                       batch=batch, heads_kv=hkv, max_seqlen=max(LENGTHS),
                                       num_splits=0, paged=page_size is not None, device=device)
        assert chosen.num_splits > 1, "the auto split count should split these sequences"
    check_against_references(out, lse, q, k_cache, v_cache, lengths, block_table, causal, dtype)
    # Rows with no key: every row of a length-0 sequence.
    empty = lengths == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=_page_id)
@pytest.mark.parametrize("seqlen_new,causal", [(1, False), (4, True)], ids=["new1", "new4-causal"])
def test_append_writes_cache_in_place(device, page_size, seqlen_new, causal):
    """k/v are written at cache_seqlens[b] .. cache_seqlens[b] + Sn - 1 (through the block table),
    nothing else in the cache changes, cache_seqlens is untouched, and attention covers the new keys."""
    dtype, hq, hkv, head_dim = torch.float16, 8, 2, 64
    lengths_list = [0, 1, 17, 30]
    batch = len(lengths_list)
    lengths = torch.tensor(lengths_list, dtype=torch.int32, device=device)
    capacity = max(lengths_list) + seqlen_new + 2           # pages 1 and 16: crosses page boundaries
    k_cache, v_cache, block_table = make_cache(batch, capacity, hkv, head_dim, dtype, device, page_size)
    q, k, v = make_qkv(batch, seqlen_new, seqlen_new, hq, hkv, head_dim, dtype, device)
    k_before, v_before, lengths_before = k_cache.clone(), v_cache.clone(), lengths.clone()

    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lengths,
                                       block_table=block_table, causal=causal, return_lse=True)

    assert torch.equal(lengths, lengths_before), "cache_seqlens must not be modified"
    k_expected, v_expected = k_before.clone(), v_before.clone()
    for b, length in enumerate(lengths_list):
        for t in range(seqlen_new):
            pos = length + t
            if page_size is None:
                page, slot = b, pos
            else:
                page, slot = int(block_table[b, pos // page_size]), pos % page_size
            k_expected[page, slot] = k[b, t]
            v_expected[page, slot] = v[b, t]
    assert torch.equal(k_cache, k_expected), "k_cache: wrong slots written or other entries changed"
    assert torch.equal(v_cache, v_expected), "v_cache: wrong slots written or other entries changed"
    check_against_references(out, lse, q, k_before, v_before, lengths, block_table, causal, dtype,
                             k=k, v=v)


def test_append_fills_cache_to_capacity(device):
    """Appending up to exactly the capacity is allowed (page size 5 does not divide the lengths)."""
    dtype, page_size = torch.float32, 5
    k_cache, v_cache, block_table = make_cache(2, 20, 1, 16, dtype, device, page_size)
    lengths = torch.tensor([17, 0], dtype=torch.int32, device=device)
    q, k, v = make_qkv(2, 3, 3, 2, 1, 16, dtype, device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                       block_table=block_table, causal=True, num_splits=2,
                                       return_lse=True)
    check_against_references(out, lse, q, k_before, v_before, lengths, block_table, True, dtype,
                             k=k, v=v)


def test_contiguous_cache_without_seqlens(device, monkeypatch):
    """cache_seqlens=None: every sequence is the whole contiguous cache; an int works too."""
    dtype = torch.float16
    q = torch.randn(3, 1, 4, 64, dtype=dtype, device=device)
    k_cache = torch.randn(3, 45, 2, 64, dtype=dtype, device=device)
    v_cache = torch.randn(3, 45, 2, 64, dtype=dtype, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=3, return_lse=True)
    check_against_references(out, lse, q, k_cache, v_cache, None, None, False, dtype)
    out_int = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=45, num_splits=3)
    assert torch.equal(out, out_int)
    # An int length is checked on the host: no device round trip, and a shorter one is honoured.
    monkeypatch.setattr(kvcache, "_check_lengths", None)           # would fail if called
    out_20, lse_20 = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20, num_splits=3,
                                             return_lse=True)
    check_against_references(out_20, lse_20, q, k_cache, v_cache,
                             torch.full((3,), 20, dtype=torch.int32, device=device), None, False, dtype)


@pytest.mark.parametrize("page_size", [None, 16], ids=_page_id)
def test_strided_inputs(device, page_size):
    """k_cache/v_cache as views of one packed [.., 2, Hkv, D] tensor, q a transposed view, the block
    table a strided column slice of a wider one: all read in place through their strides."""
    dtype = torch.float32
    k_cache, v_cache, block_table = make_cache(3, 50, 2, 40, dtype, device, page_size, packed=True)
    assert not k_cache.is_contiguous()
    if block_table is not None:
        wide = torch.full((3, 2 * block_table.shape[1]), -7, dtype=torch.int32, device=device)
        wide[:, ::2] = block_table
        block_table = wide[:, ::2]
        assert block_table.stride(1) == 2
    q = torch.randn(3, 4, 6, 40, dtype=dtype, device=device).transpose(1, 2)   # [B, Sq=6, Hq=4, D]
    lengths = torch.tensor([50, 9, 33], dtype=torch.int32, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                       block_table=block_table, causal=True, num_splits=2,
                                       return_lse=True)
    check_against_references(out, lse, q, k_cache, v_cache, lengths, block_table, True, dtype)


def splits_used(q, k_cache, block_table, max_seqlen, num_splits):
    """The split count the launcher actually runs (it lowers a request that would leave splits of the
    longest sequence without keys)."""
    return configs.decode_config(
        head_dim=q.shape[3], dtype=q.dtype, rows=q.shape[2] // k_cache.shape[2] * q.shape[1],
        batch=q.shape[0], heads_kv=k_cache.shape[2], max_seqlen=max_seqlen, num_splits=num_splits,
        paged=block_table is not None, device=q.device).num_splits


@pytest.mark.parametrize("num_splits", [1, 16], ids=["splits1", "splits16"])
def test_many_query_rows_take_several_m_blocks(device, num_splits):
    """32 query heads on one KV head x Sq 4 = 128 packed rows: more than one M tile. With several
    splits, the splits of the 2-key sequence past its keys get none (lse = -inf partials)."""
    dtype = torch.float16
    k_cache, v_cache, block_table = make_cache(2, 700, 1, 32, dtype, device, 16)
    q = torch.randn(2, 4, 32, 32, dtype=dtype, device=device)
    lengths = torch.tensor([700, 2], dtype=torch.int32, device=device)
    if num_splits > 1:
        assert splits_used(q, k_cache, block_table, 700, num_splits) > 2
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                       block_table=block_table, causal=True, num_splits=num_splits,
                                       return_lse=True)
    check_against_references(out, lse, q, k_cache, v_cache, lengths, block_table, True, dtype)


def test_softmax_scale(device):
    dtype = torch.float16
    k_cache, v_cache, block_table = make_cache(2, 40, 2, 64, dtype, device, 16)
    q = torch.randn(2, 1, 4, 64, dtype=dtype, device=device)
    lengths = torch.tensor([40, 23], dtype=torch.int32, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                       block_table=block_table, softmax_scale=0.3, return_lse=True)
    check_against_references(out, lse, q, k_cache, v_cache, lengths, block_table, False, dtype,
                             softmax_scale=0.3)
    default = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=block_table)
    explicit = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                       block_table=block_table, softmax_scale=64 ** -0.5)
    assert isinstance(default, torch.Tensor) and torch.equal(default, explicit)


CONFIGS = [
    pytest.param(DecodeConfig(16, 16, 4, 2, 1), id="M16-N16-split1"),     # page 16 == BLOCK_N
    pytest.param(DecodeConfig(16, 64, 4, 3, 2), id="M16-N64-split2"),     # page 16 < BLOCK_N: gather
    pytest.param(DecodeConfig(64, 32, 4, 2, 5), id="M64-N32-split5"),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("page_size", [None, 16, 48], ids=_page_id)
def test_decode_block_shapes(device, config, page_size):
    """Tile shapes other than the chooser's; page size 48 is a multiple of BLOCK_N 16 but not of 32."""
    dtype = torch.float16
    lengths = torch.tensor([0, 95, 1, 64], dtype=torch.int32, device=device)
    k_cache, v_cache, block_table = make_cache(4, 96, 2, 80, dtype, device, page_size)
    q = torch.randn(4, 2, 6, 80, dtype=dtype, device=device)
    max_len = int(lengths.max())
    out, lse = decode(q, k_cache, v_cache, lengths, block_table, 0, max_len, 80 ** -0.5, True,
                      config=config)
    check_against_references(out, lse, q, k_cache, v_cache, lengths, block_table, True, dtype)


def test_auto_splits_fill_the_machine(device):
    """num_splits=0 splits one long sequence over many programs (one full wave of resident programs),
    never below two key blocks per split, and never leaves a split without keys."""
    from triflash.kernels.configs import decode_config

    sms = configs.INTERPRETER_SM_COUNT if not ON_GPU else configs.sm_count(torch.device(device))
    common = dict(head_dim=128, dtype=torch.float16, rows=4, heads_kv=8, device=device)
    for paged in (False, True):
        cfg = decode_config(batch=1, max_seqlen=131072, num_splits=0, paged=paged, **common)
        assert cfg.num_splits > 1 and 8 * cfg.num_splits >= sms
        few = decode_config(batch=1, max_seqlen=cfg.block_n, num_splits=0, paged=paged, **common)
        assert few.num_splits == 1
        busy = decode_config(batch=4096, max_seqlen=131072, num_splits=0, paged=paged, **common)
        assert busy.num_splits == 1
        fixed = decode_config(batch=1, max_seqlen=131072, num_splits=3, paged=paged, **common)
        assert fixed.num_splits == 3
        # 1000 key blocks in 3 splits of 334; asking for 600 splits gives 500 of 2 (none empty).
        odd = decode_config(batch=1, max_seqlen=1000 * cfg.block_n, num_splits=600, paged=paged, **common)
        assert odd.num_splits == 500


def test_effective_splits_never_leave_a_split_empty():
    for blocks in (1, 2, 7, 64, 1000, 1024):
        for asked in (1, 2, 3, 5, 66, 132, 600):
            got = configs.effective_splits(asked, blocks * 32, 32)
            per = triton.cdiv(blocks, got)
            assert got <= asked and (got - 1) * per < blocks, (blocks, asked, got)
            assert per == triton.cdiv(blocks, min(asked, blocks))   # same share as asked for


def test_host_integer_helpers_match_tritons():
    """configs.cdiv / next_power_of_2 stand in for Triton's on the host (cheaper to call)."""
    for a in range(0, 600, 7):
        for b in (1, 2, 3, 16, 64, 100, 128):
            assert configs.cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for n in range(1, 4200):
        assert configs.next_power_of_2(n) == triton.next_power_of_2(n), n


def test_decode_config_rejects_zero_splits():
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        configs.DecodeConfig(16, 32, 4, 2, num_splits=0)


def test_without_the_seqlens_check(device, monkeypatch):
    """CHECK_SEQLENS = False (the default) skips the host-side check (no sync); results are the same."""
    dtype = torch.float16
    k_cache, v_cache, block_table = make_cache(3, 60, 2, 64, dtype, device, 16)
    q = torch.randn(3, 1, 4, 64, dtype=dtype, device=device)
    lengths = torch.tensor([60, 0, 31], dtype=torch.int32, device=device)
    monkeypatch.setattr(kvcache, "CHECK_SEQLENS", True)
    checked = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                      block_table=block_table, num_splits=2)
    monkeypatch.setattr(kvcache, "CHECK_SEQLENS", False)
    monkeypatch.setattr(kvcache, "_check_lengths", None)           # would fail if called
    unchecked = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                        block_table=block_table, num_splits=2)
    assert torch.equal(checked, unchecked)


def test_empty_batch_and_queries(device):
    dtype = torch.float16
    k_cache = torch.randn(2, 8, 1, 16, dtype=dtype, device=device)
    q = torch.randn(2, 0, 2, 16, dtype=dtype, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, k_cache, return_lse=True)
    assert out.shape == (2, 0, 2, 16) and lse.shape == (2, 2, 0)
    q = torch.randn(0, 1, 2, 16, dtype=dtype, device=device)
    out = flash_attn_with_kvcache(q, k_cache[:0], k_cache[:0],
                                  cache_seqlens=torch.zeros(0, dtype=torch.int32, device=device))
    assert out.shape == (0, 1, 2, 16)


@pytest.mark.skipif(not ON_GPU, reason="long contexts (up to 128k keys) run on the GPU only "
                                       "(the interpreter is far too slow)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("page_size", [None, 16, 256], ids=_page_id)
@pytest.mark.parametrize("lengths", [[131072], [65537, 8191, 0, 131071]], ids=["B1-128k", "B4-mixed"])
def test_long_context(device, dtype, page_size, lengths):
    hq, hkv, head_dim = 32, 8, 128
    batch = len(lengths)
    k_cache, v_cache, block_table = make_cache(batch, max(lengths), hkv, head_dim, dtype, device,
                                               page_size)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    q = torch.randn(batch, 1, hq, head_dim, dtype=dtype, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                       block_table=block_table, return_lse=True)
    check_against_references(out, lse, q, k_cache, v_cache, seqlens, block_table, False, dtype)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if a bad input reaches the cache append or the kernel launcher."""
    def boom(*args, **kwargs):
        raise AssertionError("the cache was written or a kernel launched before the bad input was rejected")
    monkeypatch.setattr(kvcache.dispatch, "decode", boom)
    monkeypatch.setattr(kvcache, "_append_kv", boom)


def _bad_inputs(device):
    f16, i32 = torch.float16, torch.int32
    q = torch.randn(2, 1, 4, 32, dtype=f16, device=device)
    kc = torch.randn(2, 10, 2, 32, dtype=f16, device=device)                 # contiguous, S_max 10
    pc = torch.randn(6, 4, 2, 32, dtype=f16, device=device)                  # 6 pages of 4
    bt = torch.tensor([[0, 1], [2, 3]], dtype=i32, device=device)            # capacity 2 * 4 = 8
    sl = torch.tensor([3, 5], dtype=i32, device=device)
    new = torch.randn(2, 1, 2, 32, dtype=f16, device=device)
    paged = dict(cache_seqlens=sl, block_table=bt)
    return [
        ("block-table-dtype", (q, pc, pc), dict(cache_seqlens=sl, block_table=bt.long()), TypeError,
         ["block_table.dtype", "torch.int32", "torch.int64"]),
        ("seqlens-int-negative", (q, kc, kc), dict(cache_seqlens=-1), ValueError, ["cache_seqlens", ">= 0", "-1"]),
        ("seqlens-int-capacity", (q, kc, kc), dict(cache_seqlens=9, k=kc[:, :2], v=kc[:, :2]), ValueError,
         ["capacity", "10", "9 + 2 = 11"]),
        ("block-table-rank", (q, pc, pc), dict(cache_seqlens=sl, block_table=bt[0]), ValueError,
         ["block_table", "2-D", "1-D"]),
        ("block-table-batch", (q, pc, pc), dict(cache_seqlens=sl, block_table=bt[:1]), ValueError,
         ["block_table.shape[0]", "2", "1"]),
        ("block-table-entry", (q, pc, pc),
         dict(cache_seqlens=sl, block_table=torch.tensor([[0, 1], [2, 6]], dtype=i32, device=device)),
         ValueError, ["block_table", "[0, 6)", "block_table[1, 1] = 6"]),
        ("seqlens-dtype", (q, kc, kc), dict(cache_seqlens=sl.long()), TypeError,
         ["cache_seqlens.dtype", "torch.int32", "torch.int64"]),
        ("seqlens-float", (q, kc, kc), dict(cache_seqlens=sl.float()), TypeError,
         ["cache_seqlens.dtype", "torch.float32"]),
        ("seqlens-shape", (q, kc, kc), dict(cache_seqlens=sl[:1]), ValueError,
         ["cache_seqlens", "(2,)", "(1,)"]),
        ("seqlens-type", (q, kc, kc), dict(cache_seqlens=[3, 5]), TypeError,
         ["cache_seqlens", "torch.Tensor", "list"]),
        ("seqlens-too-long", (q, kc, kc), dict(cache_seqlens=torch.tensor([3, 11], dtype=i32,
                                                                          device=device)),
         ValueError, ["cache_seqlens[1]", "capacity", "10", "11"]),
        ("seqlens-too-long-paged", (q, pc, pc),
         dict(cache_seqlens=torch.tensor([9, 1], dtype=i32, device=device), block_table=bt),
         ValueError, ["cache_seqlens[0]", "capacity", "8", "9"]),
        ("seqlens-too-long-after-append", (q, pc, pc),
         dict(k=torch.cat([new] * 4, 1), v=torch.cat([new] * 4, 1), **paged), ValueError,
         ["cache_seqlens[1] + seqlen_new", "capacity", "8", "5 + 4 = 9"]),
        ("seqlens-negative", (q, kc, kc), dict(cache_seqlens=torch.tensor([3, -1], dtype=i32,
                                                                          device=device)),
         ValueError, ["cache_seqlens", ">= 0", "-1"]),
        ("paged-needs-seqlens", (q, pc, pc), dict(block_table=bt), ValueError,
         ["cache_seqlens", "required", "paged"]),
        ("append-needs-seqlens", (q, kc, kc), dict(k=new, v=new), ValueError,
         ["cache_seqlens", "required"]),
        ("k-without-v", (q, kc, kc), dict(k=new, cache_seqlens=sl), ValueError,
         ["k and v", "together", "v is None"]),
        ("v-without-k", (q, kc, kc), dict(v=new, cache_seqlens=sl), ValueError,
         ["k and v", "together", "k is None"]),
        ("k-heads", (q, kc, kc), dict(k=new[:, :, :1], v=new[:, :, :1], cache_seqlens=sl),
         ValueError, ["k and v", "heads_kv=2", "(2, 1, 1, 32)"]),
        ("k-rank", (q, kc, kc), dict(k=new[0], v=new[0], cache_seqlens=sl), ValueError,
         ["k must", "4-D", "3-D"]),
        ("k-dtype", (q, kc, kc), dict(k=new.float(), v=new, cache_seqlens=sl), TypeError,
         ["k.dtype", "torch.float16", "torch.float32"]),
        ("v-shape", (q, kc, kc), dict(k=new, v=torch.cat([new, new], 1), cache_seqlens=sl),
         ValueError, ["v must", "same shape as k"]),
        ("heads-not-multiple", (torch.randn(2, 1, 3, 32, dtype=f16, device=device), kc, kc), {},
         ValueError, ["multiple", "Hq=3", "Hkv=2"]),
        ("head-dim-mismatch", (q, kc[..., :16], kc[..., :16]), {}, ValueError,
         ["head_dim", "32", "16"]),
        ("head-dim-too-big", (torch.randn(2, 1, 4, 272, dtype=f16, device=device),
                              torch.randn(2, 4, 2, 272, dtype=f16, device=device),
                              torch.randn(2, 4, 2, 272, dtype=f16, device=device)), {},
         ValueError, ["head_dim", "256", "272"]),
        ("q-rank", (q[0], kc, kc), {}, ValueError, ["q must", "4-D", "3-D"]),
        ("cache-rank", (q, kc[None], kc[None]), {}, ValueError, ["k_cache", "4-D", "5-D"]),
        ("v-cache-shape", (q, kc, kc[:, :5]), {}, ValueError, ["v_cache", "same shape as k_cache"]),
        ("cache-batch", (q, kc[:1], kc[:1]), {}, ValueError, ["k_cache.shape[0]", "2", "1"]),
        ("cache-dtype", (q, kc.float(), kc), {}, TypeError, ["k_cache.dtype", "torch.float16",
                                                              "torch.float32"]),
        ("q-dtype", (q.double(), kc.double(), kc.double()), {}, TypeError, ["q.dtype", "torch.float64"]),
        ("cache-last-dim", (q, kc.transpose(1, 3).contiguous().transpose(1, 3),
                            kc), {}, ValueError, ["k_cache", "contiguous last dimension"]),
        ("not-a-tensor", (q, kc.tolist(), kc), {}, TypeError, ["k_cache", "torch.Tensor", "list"]),
        ("num-splits-negative", (q, kc, kc), dict(num_splits=-1), ValueError, ["num_splits", "-1"]),
        ("num-splits-type", (q, kc, kc), dict(num_splits=2.0), TypeError, ["num_splits", "float"]),
        ("causal-type", (q, kc, kc), dict(causal=1), TypeError, ["causal", "bool", "int"]),
        ("scale", (q, kc, kc), dict(softmax_scale=0.0), ValueError, ["softmax_scale"]),
    ]


BAD_IDS = [case[0] for case in _bad_inputs("cpu")]


# Cases about the values inside cache_seqlens / block_table tensors: caught only with the opt-in check.
_VALUE_CASES = ("block-table-entry", "seqlens-too-long", "seqlens-too-long-paged",
                "seqlens-too-long-after-append", "seqlens-negative")


@pytest.mark.parametrize("case_id", BAD_IDS)
def test_bad_input_raises_before_launch(device, no_launch, case_id, monkeypatch):
    _, args, kwargs, exc, words = next(c for c in _bad_inputs(device) if c[0] == case_id)
    if case_id in _VALUE_CASES:
        monkeypatch.setattr(kvcache, "CHECK_SEQLENS", True)
    assert_raises_naming(exc, words, flash_attn_with_kvcache, *args, **kwargs)


def test_value_checks_are_opt_in(device):
    """By default no call reads cache_seqlens back to the host (no sync, as in FlashAttention): the
    value cases above are not checked, and each one's test switches the check on."""
    assert kvcache.CHECK_SEQLENS is False
    case_ids = {c[0] for c in _bad_inputs(device)}
    assert set(_VALUE_CASES) <= case_ids


def test_tensors_on_other_devices(device, no_launch):
    """The meta device stands in for a second device."""
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=device)
    kc = torch.randn(2, 10, 2, 32, dtype=torch.float16, device=device)
    sl = torch.tensor([3, 5], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"k_cache must be on the same device as q"):
        flash_attn_with_kvcache(q, kc.to("meta"), kc)
    with pytest.raises(ValueError, match=r"cache_seqlens must be on the same device as q"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=sl.to("meta"))
    with pytest.raises(ValueError, match=r"block_table must be on the same device as q"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=sl,
                                block_table=torch.zeros(2, 3, dtype=torch.int32, device="meta"))
    new = torch.randn(2, 1, 2, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"v must be on the same device as q"):
        flash_attn_with_kvcache(q, kc, kc, k=new, v=new.to("meta"), cache_seqlens=sl)


def test_bad_input_leaves_cache_untouched(device, monkeypatch):
    """An append that would overflow raises and writes nothing (with the opt-in value check)."""
    monkeypatch.setattr(kvcache, "CHECK_SEQLENS", True)
    kc = torch.randn(1, 4, 1, 16, dtype=torch.float16, device=device)
    before = kc.clone()
    q = torch.randn(1, 2, 1, 16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="capacity"):
        flash_attn_with_kvcache(q, kc, kc, k=q[:, :, :1], v=q[:, :, :1],
                                cache_seqlens=torch.tensor([3], dtype=torch.int32, device=device))
    assert torch.equal(kc, before)
    assert_no_nan("cache", kc)


def test_append_refuses_caches_that_share_memory(device):
    """Appending writes in place: an expanded cache (rows sharing memory), the same tensor as both
    caches, or a cache that requires grad would silently give the wrong cache or fail inside torch;
    each raises before anything is written."""
    q = torch.randn(2, 1, 2, 16, dtype=torch.float16, device=device)
    new = torch.randn(2, 1, 1, 16, dtype=torch.float16, device=device)
    kc = torch.randn(2, 8, 1, 16, dtype=torch.float16, device=device)
    vc = torch.randn(2, 8, 1, 16, dtype=torch.float16, device=device)
    expanded = torch.randn(1, 8, 1, 16, dtype=torch.float16, device=device).expand(2, 8, 1, 16)
    before = [t.clone() for t in (kc, vc, expanded)]
    f = flash_attn_with_kvcache
    assert_raises_naming(ValueError, ["k_cache", "share memory", "expanded"],
                         f, q, expanded, vc, k=new, v=new, cache_seqlens=3)
    assert_raises_naming(ValueError, ["k_cache and v_cache", "same memory"], f, q, kc, kc, k=new, v=new,
                         cache_seqlens=3)
    assert_raises_naming(ValueError, ["v_cache", "requires grad", "no backward"],
                         f, q, kc, vc.clone().requires_grad_(), k=new, v=new, cache_seqlens=3)
    # k and v unbound from one [B, S, 2, H, D] tensor share memory but no element: accepted.
    kv = torch.zeros(2, 8, 2, 1, 16, dtype=torch.float16, device=device)
    f(q, kv[:, :, 0], kv[:, :, 1], k=new, v=new * 2, cache_seqlens=3)
    assert torch.equal(kv[:, 3, 0], new[:, 0]) and torch.equal(kv[:, 3, 1], new[:, 0] * 2)
    # Rows that overlap in an as_strided view (row stride 8 < a row's 16 lanes) are refused.
    overlapping = torch.zeros(200, dtype=torch.float16, device=device).as_strided((2, 8, 1, 16), (64, 8, 16, 1))
    assert_raises_naming(ValueError, ["k_cache", "share memory"], f, q, overlapping, vc, k=new, v=new,
                         cache_seqlens=3)
    for t, b in zip((kc, vc, expanded), before):
        assert torch.equal(t, b)
    # Reading (no append) from an expanded or shared cache is fine: nothing is written.
    out = f(q, expanded, expanded, cache_seqlens=3)
    assert out.shape == q.shape


def test_decode_has_no_backward_and_says_so(device):
    q = torch.randn(1, 1, 2, 16, dtype=torch.float32, device=device, requires_grad=True)
    kc = torch.randn(1, 8, 1, 16, dtype=torch.float32, device=device)
    assert_raises_naming(ValueError, ["q requires grad", "requires grad", "no backward", "torch.no_grad()"],
                         flash_attn_with_kvcache, q, kc, kc, cache_seqlens=3)
    assert_raises_naming(ValueError, ["k_cache", "requires grad", "no backward"],
                         flash_attn_with_kvcache, q.detach(), kc.clone().requires_grad_(), kc, cache_seqlens=3)
    with torch.no_grad():
        assert flash_attn_with_kvcache(q, kc, kc, cache_seqlens=3).shape == q.shape


def test_numpy_ints_and_huge_lengths(device):
    import numpy as np
    q = torch.randn(1, 1, 2, 16, dtype=torch.float16, device=device)
    kc = torch.randn(1, 8, 1, 16, dtype=torch.float16, device=device)
    out = flash_attn_with_kvcache(q, kc, kc, cache_seqlens=np.int64(5), num_splits=np.int64(2))
    assert torch.equal(out, flash_attn_with_kvcache(q, kc, kc, cache_seqlens=5, num_splits=2))
    assert_raises_naming(ValueError, ["cache_seqlens", ">= 0", "capacity (8)", str(2**31)],
                         flash_attn_with_kvcache, q, kc, kc, cache_seqlens=2**31)


@pytest.mark.parametrize("page_size", [None, 5, 16], ids=_page_id)
@pytest.mark.parametrize("splits", [1, 3, 0], ids=["splits1", "splits3", "auto"])
@pytest.mark.parametrize("window,seqlen_q,causal", [
    pytest.param((16, -1), 1, False, id="left16-Sq1"),
    pytest.param((0, 0), 4, False, id="diagonal-Sq4"),
    pytest.param((40, 0), 4, True, id="left40-causal-Sq4"),
    pytest.param((30, 3), 4, False, id="left30-right3-Sq4"),
    pytest.param((-1, 2), 4, False, id="right2-Sq4"),
])
def test_decode_with_a_window(device, page_size, splits, window, seqlen_q, causal):
    """Local windows in flash_attn_with_kvcache (lengths 0, 1, 17 and 130 keys, an append of Sq new
    keys), against the reference with the same window."""
    dtype = torch.float16
    lengths_list = [0, 1, 17, 130]
    lengths = torch.tensor(lengths_list, dtype=torch.int32, device=device)
    k_cache, v_cache, block_table = make_cache(4, 140, 2, 32, dtype, device, page_size)
    q, k, v = make_qkv(4, seqlen_q, seqlen_q, 8, 2, 32, dtype, device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lengths,
                                       block_table=block_table, causal=causal, num_splits=splits,
                                       return_lse=True, window_size=window)
    check_against_references(out, lse, q, k_before, v_before, lengths, block_table, causal, dtype,
                             k=k, v=v, window_size=window)


def test_decode_window_bounds_near_int32_with_an_unchecked_huge_capacity(device, monkeypatch):
    """Without the lengths check the split chooser sees the capacity (here 2^31 slots through a wide
    block table over one page); bounds near 2^31 must still mean "every key", not wrap in the
    kernel's sums."""
    monkeypatch.setattr(kvcache, "CHECK_SEQLENS", False)
    cache = torch.randn(1, 65536, 1, 16, dtype=torch.float32, device=device)
    table = torch.zeros(1, 32768, dtype=torch.int32, device=device)
    for length, sq, window in ((10, 1, (-1, 2**31 - 1)), (1, 3, (2**31 - 1, -1)), (20, 2, (2**31 - 2, 2**31 - 2))):
        q = torch.randn(1, sq, 2, 16, dtype=torch.float32, device=device)
        lengths = torch.tensor([length], dtype=torch.int32, device=device)
        out, lse = flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, block_table=table,
                                           return_lse=True, window_size=window, num_splits=1)
        check_against_references(out, lse, q, cache, cache, lengths, table, False, torch.float32)

