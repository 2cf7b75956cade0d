"""Forward correctness on the issue's grid: seqlens x head dims x causal x dtype x head grouping.

On a GPU the whole cross product runs. Under the CPU interpreter the (seqlens x head dim x causal)
grid runs in full, and dtype and head grouping rotate across it so that each value of each appears
with every seqlen pair and every head dim (a pairwise cover), keeping the suite within minutes.
"""

import itertools

import pytest
import torch
from conftest import DTYPES, ON_GPU
from helpers import DTYPE_ID, HEAD_DIMS, HEADS, HEADS_ID, SEQLENS, assert_matches_reference, make_qkv

import triflash
from triflash.kernels import configs, dispatch
from triflash.kernels.configs import FwdConfig
from triflash.kernels.dispatch import forward

# On an sm_90 GPU, fp16/bf16 at head_dim 64 and 128 has two forward kernels: the Gluon Hopper kernel
# (several variants, chosen by shape) and the Triton kernel (every other GPU, the interpreter). Those
# cases run with the Triton kernel and with every Gluon variant the chooser can take, each forced.
HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)


def _paths(head_dim, dtype):
    if HOPPER and configs.gluon_hopper_applies(head_dim=head_dim, dtype=dtype, device="cuda"):
        return ["triton"] + [f"gluon:{v}" for v in dispatch.forward_candidates(head_dim, dtype)]
    return ["default"]


def _force_path(force_kernels, path):
    """Force the forward's kernel: "triton" runs the Triton kernel, "gluon:NAME" the Gluon variant NAME
    wherever the Gluon kernel can run, "default" leaves the chooser alone."""
    if path != "default":
        force_kernels(forward=path.split(":", 1)[1] if path.startswith("gluon:") else "triton")


def _cases():
    cases = []
    grid = itertools.product(enumerate(SEQLENS), enumerate(HEAD_DIMS), enumerate([False, True]))
    for (si, (sq, sk)), (di, d), (ci, causal) in grid:
        if not ON_GPU and sq * sk > 100_000 and (d, causal) not in ((40, True), (128, False)):
            # The interpreter takes 20-40 s per case at 1k x 1k: the long accumulation is checked at one
            # padded head dim (causal) and one large one (full) here; every case meets it on the GPU.
            continue
        if ON_GPU:
            combos = itertools.product(DTYPES, HEADS)
        else:
            # Rotate so that each dtype and each head grouping meets every seqlen pair, head dim and
            # causal flag (the two causal cases of one shape never share a dtype).
            combos = [(DTYPES[(si + di + ci) % len(DTYPES)], HEADS[(si + di + 2 * ci) % len(HEADS)])]
        for dtype, heads in combos:
            batch = 1 if sq * sk > 100_000 and not ON_GPU else 2
            for path in _paths(d, dtype):
                cid = (f"B{batch}-Sq{sq}-Sk{sk}-D{d}-{'causal' if causal else 'full'}-"
                       f"{DTYPE_ID[dtype]}-{HEADS_ID[heads]}" + ("" if path == "default" else f"-{path}"))
                cases.append(pytest.param(batch, sq, sk, d, causal, dtype, heads, path, id=cid))
    return cases


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,head_dim,causal,dtype,heads,path", _cases())
def test_forward_matches_reference(force_kernels, device, monkeypatch, batch, seqlen_q, seqlen_k, head_dim, causal,
                                   dtype, heads, path):
    _force_path(force_kernels, path)
    hq, hkv = heads
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, hq, hkv, head_dim, dtype, device)

    out, lse = triflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)

    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, hq, seqlen_q) and lse.dtype == torch.float32
    assert_matches_reference(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bhsd_layout_matches_bshd(device, causal):
    """attention() on [B, H, S, D] is flash_attn_func on the transposed view, bit for bit."""
    q, k, v = make_qkv(2, 6, 2, 113, 203, 64, torch.float16, device)
    out, lse = triflash.attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.is_contiguous()
    out2, lse2 = triflash.flash_attn_func(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                                          v.transpose(1, 2).contiguous(), causal=causal, return_lse=True)
    assert torch.equal(out, out2.transpose(1, 2))
    assert torch.equal(lse, lse2)


def test_default_scale_and_explicit_scale(device):
    q, k, v = (torch.randn(1, 64, 2, 40, dtype=torch.float16, device=device) for _ in range(3))
    default = triflash.flash_attn_func(q, k, v)
    explicit = triflash.flash_attn_func(q, k, v, softmax_scale=40 ** -0.5)
    assert torch.equal(default, explicit)
    scaled, lse = triflash.flash_attn_func(q, k, v, softmax_scale=0.3, return_lse=True)
    assert_matches_reference(scaled, lse, q, k, v, softmax_scale=0.3)


def test_return_lse_false_returns_tensor(device):
    q, k, v = (torch.randn(1, 16, 1, 16, dtype=torch.float16, device=device) for _ in range(3))
    out = triflash.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out = triflash.attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


CONFIGS = [
    pytest.param(FwdConfig(16, 32, 4, 2, tma="none"), id="M16-N32"),
    pytest.param(FwdConfig(32, 16, 4, 2, tma="none"), id="M32-N16"),
    pytest.param(FwdConfig(128, 64, 4, 3, tma="host"), id="M128-N64-tma_host"),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (203, 113), (96, 96)])
def test_forward_block_shapes(device, config, causal, seqlen_q, seqlen_k):
    """Other tile shapes than the chooser's, BLOCK_N > BLOCK_M included (a causal bound taken from
    BLOCK_N instead of the query block's end shows up here), with and without tensor descriptors."""
    if ON_GPU and config.tma != "none" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need sm_90+")
    dtype = torch.float16
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 80, dtype, device)
    out, lse = forward(q, k, v, 80 ** -0.5, causal, config=config)
    assert_matches_reference(out, lse, q, k, v, causal=causal)


@pytest.mark.skipif(not HOPPER, reason="the Gluon Hopper kernel runs on sm_90 GPUs only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_hopper_kernel_is_taken_where_it_applies(force_kernels, device, monkeypatch, dtype):
    """On sm_90 the forward runs the Gluon variant the chooser names (checked against the reference
    like any other); where it names none (head_dim 64, causal, short), the Triton kernel runs."""
    from triflash.kernels import forward_hopper

    calls = []
    real = forward_hopper.forward_hopper
    monkeypatch.setattr(forward_hopper, "forward_hopper",
                        lambda *a, **kw: calls.append(kw.get("variant")) or real(*a, **kw))
    q, k, v = make_qkv(2, 300, 517, 8, 2, 128, dtype, device)
    out, lse = triflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert calls == ["pp_persist"]
    assert_matches_reference(out, lse, q, k, v, causal=True)
    q64, k64, v64 = make_qkv(2, 300, 517, 8, 2, 64, dtype, device)
    triflash.flash_attn_func(q64, k64, v64)
    assert calls == ["pp_persist", "pp_persist"]
    triflash.flash_attn_func(q64, k64, v64, causal=True)     # head_dim 64, causal, 300 queries: Triton
    assert len(calls) == 2
    # head_dim 64, non-causal, from 1k queries: three warpgroups; fp16 takes the row sums on the
    # tensor cores.
    q64, k64, v64 = make_qkv(1, 1100, 1200, 4, 4, 64, dtype, device)
    out, lse = triflash.flash_attn_func(q64, k64, v64, return_lse=True)
    assert calls[2:] == ["pp3_persist_ltc" if dtype == torch.float16 else "pp3_persist"]
    assert_matches_reference(out, lse, q64, k64, v64)
    _force_path(force_kernels, "triton")
    triflash.flash_attn_func(q, k, v, causal=True)
    assert len(calls) == 3


@pytest.mark.skipif(not HOPPER, reason="the Gluon Hopper kernel runs on sm_90 GPUs only")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, head_dim, variant", [
    (dtype, d, v) for d in dispatch.HOPPER_FORWARD_VARIANTS for dtype in (torch.float16, torch.bfloat16)
    for v in dispatch.forward_candidates(d, dtype)],
    ids=lambda x: DTYPE_ID[x] if isinstance(x, torch.dtype) else str(x))
def test_hopper_many_tiles_per_cta(force_kernels, device, monkeypatch, dtype, head_dim, variant, causal):
    """Every variant the forward takes (per dtype and head dim), with more work items than SMs, so a
    persistent CTA runs several tiles: the K/V ring position, the
    ping-pong turn and the query barriers' phase carry over from tile to tile, and each O tile is
    reused after its previous TMA store. Sq != Sk with an odd number of query blocks (where the
    tile order is paired, causal pairs the middle block with itself). The suite's grid has at most
    96 items, fewer than the 132 SMs."""
    from triflash.kernels import forward_hopper

    _force_path(force_kernels, f"gluon:{variant}")
    cfg = forward_hopper.variant_config(variant, head_dim)
    batch, hq, hkv, seqlen_q, seqlen_k = 2, 16, 4, 2100, 2300
    num_m_blocks = -(-seqlen_q // cfg["block_m"])
    order = forward_hopper.tile_order(causal, cfg["persistent"], cfg["block_m"])
    items = batch * hq * ((num_m_blocks + 1) // 2 if order == "paired" else num_m_blocks)
    assert num_m_blocks % 2 == 1 and items > configs.sm_count(device)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, hq, hkv, head_dim, dtype, device)
    out, lse = triflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert_matches_reference(out, lse, q, k, v, causal=causal)


@pytest.mark.skipif(not HOPPER, reason="the Gluon Hopper kernel runs on sm_90 GPUs only")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "one-tile"])
@pytest.mark.parametrize("variant", ["pp3_persist", "pp3_persist_ltc"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_hopper_split_loops_match_one_loop(device, monkeypatch, dtype, variant, persistent, causal):
    """The split-loop schedule (overlap=2: unmasked steps, then masked ones, in two loops) does the same
    arithmetic in the same order as the one-loop body (overlap=True), step for step: the outputs and
    LSEs are equal bit for bit. (Causal, the split forms also skip the key blocks a warpgroup does
    not see, docs/hopper.md#skipping-blocks-a-warpgroup-does-not-see, and the one-loop form walks them
    all: the same bits still.)
    Shapes with tiles of no masked step, of masked steps only (causal, the first query block) and of
    both, with a key tail, so an off-by-one in the loops' ranges (a step run twice, skipped, or
    masked the wrong way) changes the result."""
    from triflash.kernels import forward_hopper

    cfg = dict(forward_hopper.VARIANTS[variant][64], persistent=persistent)
    if cfg.get("ltc") and dtype != torch.float16:
        pytest.skip("LTC variants take fp16 only")
    assert cfg["overlap"] == 2
    variant = "split_loops"
    monkeypatch.setitem(forward_hopper.VARIANTS, variant, {64: cfg})
    monkeypatch.setitem(forward_hopper.VARIANTS, "one_loop", {64: dict(cfg, overlap=True)})
    for seqlen_q, seqlen_k in ((700, 1000), (1100, 1100), (2100, 2300)):
        q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 64, dtype, device)
        out, lse = forward_hopper.forward_hopper(q, k, v, 0.125, causal, variant=variant)
        ref_out, ref_lse = forward_hopper.forward_hopper(q, k, v, 0.125, causal, variant="one_loop")
        assert torch.equal(out, ref_out), (seqlen_q, seqlen_k)
        assert torch.equal(lse, ref_lse), (seqlen_q, seqlen_k)


@pytest.mark.skipif(not HOPPER, reason="the Gluon Hopper kernel runs on sm_90 GPUs only")
@pytest.mark.parametrize("dtype, variant", [
    (torch.float16, "pp3_persist_ltc"), (torch.float16, "pp3_persist"), (torch.bfloat16, "pp3_persist")],
    ids=lambda x: DTYPE_ID.get(x, str(x)))
def test_hopper_skipped_blocks_match_walking_all(device, monkeypatch, dtype, variant):
    """Causal, 192-row tiles: a warpgroup computes only on the key blocks its own rows see
    (``_blocks_seen``) and passes the rest of its tile's blocks on (``_pass_blocks``). The blocks
    it skips are wholly masked for its rows (above its causal diagonal) or belong to rows past the
    end of the queries, and folding a wholly masked block changes nothing (p = 0, alpha = 1
    exactly), so out and LSE are equal bit for bit to the form where every warpgroup walks all of
    the tile's blocks (skip=False). Persistent (snake order) and one-tile-per-CTA variants. Shapes:
    a last tile whose lower warpgroups have no rows (1000 = 5 x 192 + 40; 40 rows, one tile),
    tiles with one or two warpgroups a block short (tiles starting at multiples of 128, and at 64
    past one), Sq < Sk, Sq < Sk by one (a block count off by one key shows there), Sq > Sk (rows
    that see no key; at 1100 against 1000 the first tile's first warpgroup sees none of the tile's
    one block), and more tiles than SMs, so that a CTA runs its next tile after one where
    warpgroups passed blocks, or passed all of them (B4 H16 S1000: every head's last tile). Every
    ``out`` starts as NaN, and every result stays referenced. A wrong turn count would hang here
    (the turn barriers check parity only), not give wrong values."""
    from triflash.kernels import forward_hopper

    head_dim = 64
    cfg = forward_hopper.VARIANTS[variant][head_dim]
    monkeypatch.setitem(forward_hopper.VARIANTS, "walk_all", {head_dim: dict(cfg, skip=False)})
    assert forward_hopper.variant_config(variant, head_dim)["skip"]
    assert not forward_hopper.variant_config("walk_all", head_dim)["skip"]
    results = []
    for batch, hq, hkv, seqlen_q, seqlen_k in ((2, 4, 2, 1000, 1000), (1, 4, 1, 1100, 1300),
                                               (1, 4, 2, 1000, 1001), (2, 4, 4, 1500, 900),
                                               (2, 4, 4, 1100, 1000), (2, 16, 4, 2100, 2300),
                                               (4, 16, 4, 1000, 1000), (8, 16, 4, 1100, 1000),
                                               (1, 2, 2, 40, 40)):
        q, k, v = make_qkv(batch, seqlen_q, seqlen_k, hq, hkv, head_dim, dtype, device)
        pair = []
        for name in (variant, "walk_all"):
            out = torch.full_like(q, float("nan"))
            pair.append(forward_hopper.forward_hopper(q, k, v, 0.1, True, out=out, variant=name))
        results.append(pair)
        (out, lse), (ref_out, ref_lse) = pair
        assert torch.equal(out, ref_out), (batch, hq, seqlen_q, seqlen_k)
        assert torch.equal(lse, ref_lse), (batch, hq, seqlen_q, seqlen_k)
        assert_matches_reference(out, lse, q, k, v, causal=True, softmax_scale=0.1)


@pytest.mark.skipif(not HOPPER, reason="the Gluon Hopper kernel runs on sm_90 GPUs only")
@pytest.mark.parametrize("head_dim, variant", [(64, "pp_persist"), (128, "pp_persist"), (64, "pp3_persist"),
                                               (64, "pp3_persist_ltc"), (128, "pp")])
def test_hopper_tile_orders_match(device, head_dim, variant):
    """The persistent loop's tile orders (plain, paired, snake, and plain and snake in sections of 2
    and 3 heads, the last section smaller) only change which CTA runs which tile and when; each
    tile's arithmetic is the same, so out and LSE are equal bit for bit. Causal, with
    more tiles than SMs and a last round the grid does not fill (snake's overhang) after an even
    round (B2 H16) and after an odd, reversed one (B1 H14: 238 tiles of 128 rows, 154 of 192), with
    fewer tiles than SMs, and with Sq > Sk (query blocks that see no key: zero work, still visited),
    alone (B2 H4) and among other tiles of the same CTAs (B4 H16: several rounds)."""
    from triflash.kernels import forward_hopper

    for batch, hq, hkv, seqlen_q, seqlen_k in ((2, 16, 4, 2100, 2300), (1, 14, 2, 2100, 2300),
                                               (1, 3, 1, 700, 1000), (2, 4, 2, 1500, 900),
                                               (4, 16, 4, 1500, 900)):
        q, k, v = make_qkv(batch, seqlen_q, seqlen_k, hq, hkv, head_dim, torch.float16, device)
        plain = forward_hopper.forward_hopper(q, k, v, 0.1, True, variant=variant, order="plain")
        assert_matches_reference(*plain, q, k, v, causal=True, softmax_scale=0.1)
        # Every result stays referenced and every output starts as NaN, so a tile that an order
        # skips cannot pass by leaving another call's values in a reused buffer (the LSE is
        # allocated by the launcher: kept alive, it is never a buffer the previous call filled).
        results = []
        for order, section in (("paired", None), ("snake", None), ("snake", 2), ("snake", 3),
                               ("plain", 2), ("plain", 3)):
            out = torch.full_like(q, float("nan"))
            results.append(forward_hopper.forward_hopper(q, k, v, 0.1, True, out=out, variant=variant,
                                                         order=order, section=section))
            out, lse = results[-1]
            assert torch.equal(out, plain[0]), (order, section, batch, hq, seqlen_q, seqlen_k)
            assert torch.equal(lse, plain[1]), (order, section, batch, hq, seqlen_q, seqlen_k)


def test_hopper_tile_order_rule():
    """``forward_hopper.tile_order``: plain unless causal and persistent; paired for 128-row tiles
    (snake was slower at every measured shape there), snake for 192-row ones."""
    from triflash.kernels import forward_hopper

    order = forward_hopper.tile_order
    assert order(False, True, 192) == "plain"
    assert order(True, False, 192) == "plain"
    assert order(True, True, 192) == "snake"
    assert order(True, True, 128) == "paired"


def test_hopper_snake_section_rule():
    """``forward_hopper.snake_section`` (192-row tiles of 128-key blocks, 132 CTAs): the sections the
    timings of run 74 favoured, where its model (the busiest CTA's work over the mean, times a cost
    for the heads run at once) tells them apart. One section where all heads' tiles are few enough
    to share K/V (B2 H16: 32 heads; sections of 16 there leave the busiest CTA 22% over the
    mean), sections of 16 at B4 H16 S4k (one section leaves 2 CTAs per
    head; 8 leave the busiest CTA 11% over the mean), 8 at B1 H32 S16k."""
    from triflash.kernels import forward_hopper

    def pick(batch, heads, seqlen, seqlen_k=None):
        return forward_hopper.snake_section(batch * heads, -(-seqlen // 192), 192, 128, seqlen,
                                            seqlen_k or seqlen, 132)

    assert pick(2, 16, 8192) == 32
    assert pick(2, 16, 4096) == 32
    assert pick(4, 16, 4096) == 16
    assert pick(4, 32, 4096) == 8
    assert pick(1, 32, 16384) == 8
    # Sections of 1-4 heads deal the same loads here and run about 6 heads at once: a tie, which
    # goes to the larger section (4 was timed, 405.5 against 408.6 in sections of 16).
    assert pick(8, 32, 4096) == 4
    assert pick(1, 1, 4096) == 1
    # GQA: the query heads of a group read one K/V, so larger sections keep the same reuse.
    assert forward_hopper.snake_section(128, 22, 192, 128, 4096, 4096, 132, 4) == 32


def test_hopper_by_cost_order():
    """``forward_hopper.by_cost`` (the host copy of the kernel's ``_by_cost``, which ``snake_section``
    models the kernel with): every tile number maps to a distinct (query block, head) pair, for
    every section, a last section smaller than the others included; a section of 1 is the plain
    causal order (one head after the other, heaviest block first) and a section of all heads the
    snake's one-section order (all heads' heaviest blocks first)."""
    from triflash.kernels import forward_hopper

    for m_blocks in (1, 2, 5):
        for num_bh in (1, 3, 8, 12):
            t = torch.arange(m_blocks * num_bh)
            for section in range(1, num_bh + 1):
                m, bh = forward_hopper.by_cost(t, m_blocks, num_bh, section)
                assert sorted(zip(m.tolist(), bh.tolist())) == [(i, j) for i in range(m_blocks)
                                                                for j in range(num_bh)]
                # Within a section, the query blocks never grow (the heaviest first).
                sec = bh // section
                for s in sec.unique():
                    ms = m[sec == s]
                    assert torch.all(ms[1:] <= ms[:-1])
            m, bh = forward_hopper.by_cost(t, m_blocks, num_bh, 1)
            assert torch.equal(m, m_blocks - 1 - t % m_blocks) and torch.equal(bh, t // m_blocks)
            m, bh = forward_hopper.by_cost(t, m_blocks, num_bh, num_bh)
            assert torch.equal(m, m_blocks - 1 - t // num_bh) and torch.equal(bh, t % num_bh)


def test_hopper_order_argument_is_checked():
    """forward_hopper's ``order`` and ``section`` are checked before anything else, empty inputs
    included, and the errors name the argument, the choices or what is expected, and what was
    given."""
    from triflash.kernels import forward_hopper

    q = torch.randn(1, 64, 1, 64, dtype=torch.float16)
    empty = torch.randn(1, 0, 1, 64, dtype=torch.float16)
    for args in ((q, q, q), (empty, q, q), (q, empty, empty)):
        for bad in ("zigzag", ["snake"]):
            with pytest.raises(ValueError, match=r"order must be one of \['paired', 'plain', 'snake'\]"):
                forward_hopper.forward_hopper(*args, 0.1, True, variant="pp_persist", order=bad)
        for bad in (0, -2, 2.0, True, "4"):
            with pytest.raises(ValueError, match=r"section must be a positive int or None; got section="):
                forward_hopper.forward_hopper(*args, 0.1, True, variant="pp_persist", order="snake",
                                              section=bad)


def test_hopper_variant_chooser(monkeypatch):
    """The chooser's rules (dispatch.forward_variant): None off sm_90 (here: a CPU device), and
    with the sm_90 check stubbed to pass, the variant per head dim, causality and length."""
    from triflash.kernels import forward_hopper

    pick = dispatch.forward_variant
    kw = dict(dtype=torch.float16, device="cpu")
    assert pick(head_dim=128, causal=False, seqlen_q=4096, seqlen_k=4096, **kw) == "triton"
    monkeypatch.setattr(configs, "gluon_hopper_applies",
                        lambda *, head_dim, dtype, device: head_dim in (64, 128))
    assert pick(head_dim=128, causal=False, seqlen_q=1024, seqlen_k=1024, **kw) == "pp_persist"
    assert pick(head_dim=128, causal=False, seqlen_q=16384, seqlen_k=16384, **kw) == "pp"
    assert pick(head_dim=128, causal=True, seqlen_q=16384, seqlen_k=16384, **kw) == "pp_persist"
    assert pick(head_dim=64, causal=True, seqlen_q=1024, seqlen_k=1024, **kw) == "triton"
    assert pick(head_dim=64, causal=True, seqlen_q=2047, seqlen_k=2047, **kw) == "triton"
    assert pick(head_dim=64, causal=True, seqlen_q=2048, seqlen_k=2048, **kw) == "pp3_persist_ltc"
    assert pick(head_dim=64, causal=True, seqlen_q=4096, seqlen_k=4096, **kw) == "pp3_persist_ltc"
    # fp16 at D=64: the row sums on the tensor cores; bf16 keeps fp32 row sums (its LSE).
    assert pick(head_dim=64, causal=False, seqlen_q=512, seqlen_k=512, **kw) == "pp_persist"
    assert pick(head_dim=64, causal=False, seqlen_q=1024, seqlen_k=1024, **kw) == "pp3_persist_ltc"
    assert pick(head_dim=64, causal=False, seqlen_q=16384, seqlen_k=16384, **kw) == "pp3_persist_ltc"
    assert pick(head_dim=64, causal=True, seqlen_q=16384, seqlen_k=16384, **kw) == "pp3_persist_ltc"
    assert pick(head_dim=64, causal=True, seqlen_q=8192, seqlen_k=8192, **kw) == "pp3_persist_ltc"
    bf16 = dict(kw, dtype=torch.bfloat16)
    assert pick(head_dim=64, causal=False, seqlen_q=512, seqlen_k=512, **bf16) == "pp_persist"
    assert pick(head_dim=64, causal=False, seqlen_q=4096, seqlen_k=4096, **bf16) == "pp3_persist"
    assert pick(head_dim=64, causal=False, seqlen_q=16384, seqlen_k=16384, **bf16) == "pp3_persist"
    assert pick(head_dim=64, causal=True, seqlen_q=2048, seqlen_k=2048, **bf16) == "pp3_persist"
    assert pick(head_dim=64, causal=True, seqlen_q=4096, seqlen_k=4096, **bf16) == "pp3_persist"
    assert pick(head_dim=64, causal=True, seqlen_q=8192, seqlen_k=8192, **bf16) == "pp3_persist"
    assert pick(head_dim=64, causal=True, seqlen_q=16384, seqlen_k=16384, **bf16) == "pp3_persist"
    assert pick(head_dim=80, causal=False, seqlen_q=4096, seqlen_k=4096, **kw) == "triton"
    # Local windows (left, right): at 128 always the persistent kernel; at 64 by the keys a query sees
    # (Triton below 2048, two warpgroups below 4096), never the _ltc form.
    assert pick(head_dim=128, causal=False, seqlen_q=16384, seqlen_k=16384, window=(512, 512), **kw) == "pp_persist"
    assert pick(head_dim=128, causal=True, seqlen_q=8192, seqlen_k=8192, window=(256, 0), **kw) == "pp_persist"
    for window, want in (((1024, 0), "triton"), ((2046, 0), "triton"), ((2047, 0), "pp_persist"),
                         ((1023, 1024), "pp_persist"), ((4095, 0), "pp3_persist"), ((-1, 300), "pp3_persist")):
        for dtype in (torch.float16, torch.bfloat16):
            got = pick(head_dim=64, causal=window[1] == 0, seqlen_q=8192, seqlen_k=8192, window=window,
                       device="cpu", dtype=dtype)
            assert got == want, (window, dtype, got)
    assert pick(head_dim=64, causal=True, seqlen_q=1024, seqlen_k=8192, window=(4096, 0), **kw) == "triton"
    # Packed sequences (by the longest): never the _ltc form; at 128 one tile per CTA (pp), but with a
    # window as dense.
    assert pick(head_dim=64, causal=True, seqlen_q=4096, seqlen_k=4096, packed=True, **kw) == "pp3_persist"
    assert pick(head_dim=64, causal=False, seqlen_q=512, seqlen_k=512, packed=True, **kw) == "pp_persist"
    assert pick(head_dim=64, causal=True, seqlen_q=2008, seqlen_k=2008, packed=True, **kw) == "triton"
    assert pick(head_dim=128, causal=True, seqlen_q=4096, seqlen_k=4096, packed=True, **kw) == "pp"
    assert pick(head_dim=128, causal=False, seqlen_q=512, seqlen_k=512, packed=True, **kw) == "pp"
    assert pick(head_dim=128, causal=True, seqlen_q=4096, seqlen_k=4096, packed=True, window=(256, 0),
                **kw) == "pp_persist"
    assert pick(head_dim=64, causal=True, seqlen_q=2048, seqlen_k=16384, **kw) == "pp3_persist_ltc"
    # Causal from 2k queries with fewer keys: untimed, so 128-row tiles as before.
    assert pick(head_dim=64, causal=True, seqlen_q=4096, seqlen_k=2047, **kw) == "pp_persist"
    assert pick(head_dim=64, causal=True, seqlen_q=4096, seqlen_k=2047, **bf16) == "pp_persist"
    assert pick(head_dim=64, causal=False, seqlen_q=512, seqlen_k=16384, **kw) == "pp_persist"
    lengths = (1, 512, 1000, 1024, 2048, 8192, 16384, 65536)
    for d in dispatch.HOPPER_FORWARD_VARIANTS:
        for dtype in (torch.float16, torch.bfloat16):
            names = dispatch.forward_candidates(d, dtype)
            assert all(d in forward_hopper.VARIANTS[n] for n in names)
            # LTC variants take fp16 only (forward_hopper refuses bf16).
            assert dtype == torch.float16 or not any(forward_hopper.variant_config(n, d)["ltc"] for n in names)
            # The picks are exactly the candidates the forward tests force: every pick is tested on
            # the GPU, and no candidate is tested without ever being taken.
            picks = {pick(head_dim=d, causal=c, seqlen_q=sq, seqlen_k=sk, **dict(kw, dtype=dtype))
                     for c in (False, True) for sq in lengths for sk in lengths}
            assert picks - {"triton"} == set(names)


def test_hopper_ltc_variant_refuses_bf16():
    """An LTC variant sums the rows of an fp16 P: forced on bf16 it raises, naming the variant and
    the dtype (checked before any launch, so this runs on the CPU)."""
    from triflash.kernels import forward_hopper

    q, k, v = make_qkv(1, 64, 64, 2, 2, 64, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match=r"pp3_persist_ltc.*float16.*bfloat16"):
        forward_hopper.forward_hopper(q, k, v, 0.125, False, variant="pp3_persist_ltc")


def test_bfloat16_is_computed_correctly_everywhere(device):
    """bf16 forward, backward and decode against the float64 reference, on the GPU and in Triton's CPU
    interpreter too (whose tl.dot multiplies bf16's raw bits unless triflash.kernels.interpreter widens them
    there: outputs came back around 1e8)."""
    from helpers import assert_2x_rule, assert_grads_3x

    from triflash.reference import flash_attn_ref

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 37, 4, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
               for _ in range(3))
    out = triflash.flash_attn_func(q, k, v, causal=True)
    ref64 = flash_attn_ref(q, k, v, True, compute_dtype=torch.float64)
    same = flash_attn_ref(q, k, v, True, compute_dtype=None)
    assert_2x_rule("bf16 out", out, ref64, same, torch.bfloat16)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_3x(grads, q, k, v, dout, True, torch.bfloat16)
    with torch.no_grad():
        got = triflash.flash_attn_with_kvcache(q[:, -1:], k, v)
    assert_2x_rule("bf16 decode", got, ref64[:, -1:], same[:, -1:], torch.bfloat16)
