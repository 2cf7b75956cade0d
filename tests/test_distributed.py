"""Context parallelism (triflash.distributed): ring and all-gather attention over torch.distributed.

Four parts, cheapest first:

* planning, pure Python: the pieces each ring step launches cover exactly the visible (query, key)
  pairs of the full sequence, once each, with the kernels' bottom-right masks; zigzag balances causal
  work (every rank within one block of the others); sharding helpers round-trip.
* the ring in one process (``simulate_ring_attention``: W virtual ranks, transfers replaced by copies):
  out and lse within the 2x rule, dQ/dK/dV within the 3x rule (tests/helpers.py), causal, windows, GQA.
* spawned processes over gloo (one spawn of 4 processes; groups of 1, 2 and 4 ranks inside it):
  ``ring_flash_attn_func`` and ``allgather_flash_attn_func`` against the same rules, on real P2P.
* on a CUDA GPU (skipped without one): the ring on the GPU (virtual ranks, and a one-rank NCCL group)
  and the per-step timing hook.
"""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import assert_grads_3x, assert_matches_reference, assert_raises_naming

from triflash import distributed as cp
from triflash.reference import causal_visible

ON_GPU = torch.cuda.is_available()


# -- planning ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sharding", cp.SHARDINGS)
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (5, -1)), (True, (0, 0)),
                                           (False, (3, 6)), (False, (-1, 2)), (False, (9, -1)), (True, (40, -1))],
                         ids=["causal", "full", "causal-w5", "causal-w0", "w3-6", "w-1-2", "w9", "causal-w40"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pieces_cover_the_visible_pairs_once(world, causal, window, sharding):
    """Every (query, key) pair the full sequence's mask shows is computed by exactly one piece of one
    step, under the kernel's own mask for that piece (bottom-right aligned, translated window)."""
    seqlen = 48 if world == 3 else 32
    local = seqlen // world
    covered = torch.zeros(seqlen, seqlen, dtype=torch.int32)
    for rank in range(world):
        qpos = cp.shard_positions(seqlen, rank, world, sharding=sharding)
        for step in range(cp.ring_steps(seqlen, world, sharding=sharding, causal=causal, window_size=window)):
            kpos = cp.shard_positions(seqlen, (rank - step) % world, world, sharding=sharding)
            for p in cp._step_pieces(sharding, world, local, rank, step, causal, window):
                assert all(w >= -1 for w in p.window) and (not p.causal or p.window[1] <= 0), p
                mask = causal_visible(p.q1 - p.q0, p.k1 - p.k0, window_size=p.window, causal=p.causal)
                i, j = torch.nonzero(mask, as_tuple=True)
                covered.index_put_((qpos[p.q0:p.q1][i], kpos[p.k0:p.k1][j]), torch.ones_like(i, dtype=torch.int32),
                                   accumulate=True)
    assert torch.equal(covered, causal_visible(seqlen, seqlen, window_size=window, causal=causal).int())


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_zigzag_balances_causal_work(world):
    """Zigzag: at every step every rank computes the same number of visible scores, and in all each
    rank is within one block (chunk x chunk) of the others; contiguous sharding is not (the check bites)."""
    seqlen = 16 * world
    chunk = seqlen // (2 * world)
    work = cp.rank_work(seqlen, world, sharding="zigzag", causal=True)
    totals = work.sum(1)
    assert int(totals.max() - totals.min()) <= chunk * chunk
    assert all(len(set(col.tolist())) == 1 for col in work.T[1:])       # each later step: equal work
    assert int(totals.sum()) == seqlen * (seqlen + 1) // 2
    if world > 1:
        computed = cp.rank_work(seqlen, world, sharding="zigzag", causal=True, count="computed")
        assert int(computed[:, 1:].max() - computed[:, 1:].min()) == 0   # equal launches, too
        contiguous = cp.rank_work(seqlen, world, sharding="contiguous", causal=True).sum(1)
        assert int(contiguous.max() - contiguous.min()) > chunk * chunk


def test_window_shortens_the_ring():
    # contiguous, L = 16, left window 20: a query reaches 2 blocks back at most -> 3 steps of 8
    assert cp.ring_steps(128, 8, sharding="contiguous", causal=True, window_size=(20, -1)) == 3
    assert cp.ring_steps(128, 8, sharding="contiguous", causal=True) == 8
    assert cp.ring_steps(128, 8, sharding="contiguous", causal=True, window_size=(0, 0)) == 1


@pytest.mark.parametrize("sharding", cp.SHARDINGS)
def test_shard_unshard_round_trip(sharding):
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    shards = [cp.shard_sequence(x, r, 3, sharding=sharding) for r in range(3)]
    assert torch.equal(cp.unshard_sequence(shards, sharding=sharding), x)
    for r in range(3):
        assert torch.equal(shards[r][0, :, 0] // 3, cp.shard_positions(24, r, 3, sharding=sharding))
    assert cp.shard_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert cp.shard_positions(8, 1, 2).tolist() == [2, 3, 4, 5]


# -- the ring in one process ------------------------------------------------------------------------------

CASES = [
    pytest.param(4, "zigzag", True, (-1, -1), (2, 2), torch.float32, id="W4-zigzag-causal-fp32"),
    pytest.param(4, "zigzag", True, (-1, -1), (4, 2), torch.float16, id="W4-zigzag-causal-gqa2-fp16"),
    pytest.param(2, "contiguous", False, (-1, -1), (2, 1), torch.bfloat16, id="W2-contig-full-mqa-bf16"),
    pytest.param(4, "contiguous", True, (5, -1), (2, 1), torch.float16, id="W4-contig-causal-w5-mqa-fp16"),
    pytest.param(4, "zigzag", False, (3, 6), (2, 2), torch.float32, id="W4-zigzag-w3-6-fp32"),
    pytest.param(3, "zigzag", True, (-1, -1), (2, 2), torch.float32, id="W3-zigzag-causal-fp32"),
]


@pytest.mark.parametrize("world,sharding,causal,window,heads,dtype", CASES)
def test_simulated_ring_matches_reference(world, sharding, causal, window, heads, dtype, device):
    seqlen = 48 if world == 3 else 32
    q = torch.randn(1, seqlen, heads[0], 16, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(1, seqlen, heads[1], 16, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    out, lse = cp.simulate_ring_attention(q, k, v, world_size=world, causal=causal, window_size=window,
                                          sharding=sharding, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_matches_reference(out, lse, q.detach(), k.detach(), v.detach(), causal=causal, window_size=window)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward((out, lse), (dout, dlse))
    assert_grads_3x([q.grad, k.grad, v.grad], q.detach(), k.detach(), v.detach(), dout, causal, dtype, dlse=dlse,
                    window_size=window)


# -- spawned processes over gloo ---------------------------------------------------------------------------

# (group ranks, fn, sharding, causal, window, (Hq, Hkv), dtype, loss on lse)
SPAWN_CASES = [
    ((1,), "ring", "zigzag", True, (-1, -1), (2, 2), torch.float32, False),
    ((1,), "allgather", "contiguous", True, (-1, -1), (2, 1), torch.float32, False),
    ((2, 3), "ring", "zigzag", True, (-1, -1), (2, 1), torch.float16, True),
    ((2, 3), "ring", "contiguous", False, (-1, -1), (2, 2), torch.float32, False),
    ((2, 3), "allgather", "zigzag", True, (-1, -1), (2, 1), torch.float32, False),
    ((0, 1, 2, 3), "ring", "zigzag", True, (-1, -1), (2, 2), torch.float32, True),
    ((0, 1, 2, 3), "ring", "contiguous", True, (5, -1), (2, 1), torch.float16, False),
    ((0, 1, 2, 3), "allgather", "zigzag", True, (-1, -1), (2, 1), torch.float32, False),
]


def _spawned_worker(rank, world, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        groups = {ranks: dist.new_group(list(ranks)) for ranks in sorted({c[0] for c in SPAWN_CASES})}
        for n, (ranks, fn, sharding, causal, window, heads, dtype, lse_loss) in enumerate(SPAWN_CASES):
            if rank not in ranks:
                continue
            group, size = groups[ranks], len(ranks)
            me = dist.get_rank(group)
            gen = torch.Generator().manual_seed(1000 + n)               # every rank: the same full tensors
            seqlen = 32
            q = torch.randn(1, seqlen, heads[0], 16, generator=gen).to(dtype)
            k, v = (torch.randn(1, seqlen, heads[1], 16, generator=gen).to(dtype) for _ in range(2))
            dout = torch.randn(q.shape, generator=gen).to(dtype)
            dlse = torch.randn(1, heads[0], seqlen, generator=gen) if lse_loss else None
            leaves = [cp.shard_sequence(t, me, size, sharding=sharding).requires_grad_() for t in (q, k, v)]
            attn = cp.ring_flash_attn_func if fn == "ring" else cp.allgather_flash_attn_func
            out, lse = attn(*leaves, group=group, causal=causal, window_size=window, sharding=sharding,
                            return_lse=True)
            loss = (out.float() * cp.shard_sequence(dout, me, size, sharding=sharding).float()).sum()
            if dlse is not None:
                loss = loss + (lse * cp.shard_sequence(dlse, me, size, sharding=sharding, dim=2)).sum()
            loss.backward()
            full = [cp.gather_sequence(t, group=group, sharding=sharding) for t in (out, *(x.grad for x in leaves))]
            full_lse = cp.gather_sequence(lse, group=group, sharding=sharding, dim=2)
            if me == 0:
                where = f"case {n} ({fn}, W={size}, {sharding}, causal={causal}, window={window}, {dtype})"
                try:
                    assert_matches_reference(full[0], full_lse, q, k, v, causal=causal, window_size=window)
                    assert_grads_3x(full[1:], q, k, v, dout, causal, dtype, dlse=dlse, window_size=window)
                except AssertionError as err:
                    raise AssertionError(f"{where}: {err}") from None
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(ON_GPU, reason="gloo runs CPU tensors, which need the interpreter (no CUDA GPU); several GPUs over "
                                     "NCCL are a separate run")
def test_spawned_gloo_world_sizes_1_2_4(tmp_path):
    """4 processes; inside them a group of 1 (rank 1), of 2 (ranks 2, 3: peers are not group ranks) and
    the whole world of 4, each running the ring and the all-gather variant."""
    mp.spawn(_spawned_worker, args=(4, str(tmp_path / "store")), nprocs=4, join=True)


# -- validation -------------------------------------------------------------------------------------------

def test_bad_inputs_raise_naming_the_argument(device):
    q = torch.randn(1, 8, 2, 16, device=device)
    kv = torch.randn(1, 8, 2, 16, device=device)
    ring = cp.ring_flash_attn_func
    assert_raises_naming(TypeError, ["q must", "Tensor", "list"], ring, [1.0], kv, kv)
    assert_raises_naming(TypeError, ["k.dtype", "float16"], ring, q, kv.half(), kv)
    assert_raises_naming(ValueError, ["k and v", "seqlen 8", "seqlen 4"], ring, q, kv[:, :4], kv[:, :4])
    assert_raises_naming(ValueError, ["sharding", "zigzag", "'striped'"], ring, q, kv, kv, sharding="striped")
    assert_raises_naming(ValueError, ["q must", "even", "seqlen 7"], ring, q[:, :7], kv[:, :7], kv[:, :7])
    assert_raises_naming(TypeError, ["window_size", "pair"], ring, q, kv, kv, window_size=3)
    assert_raises_naming(ValueError, ["window_size[1]", "causal"], ring, q, kv, kv, causal=True, window_size=(2, 2))
    assert_raises_naming(TypeError, ["return_lse", "bool"], ring, q, kv, kv, return_lse=1)
    assert_raises_naming(TypeError, ["keyword"], ring, q, kv, kv, 0.5)
    if not dist.is_initialized():
        assert_raises_naming(ValueError, ["group", "init_process_group"], ring, q, kv, kv)
        assert_raises_naming(ValueError, ["group", "init_process_group"], cp.allgather_flash_attn_func, q, kv, kv)
    assert_raises_naming(ValueError, ["x", "divisible by 6", "8"], cp.shard_sequence, q, 0, 3)
    assert_raises_naming(ValueError, ["rank", "[0, 2)", "2"], cp.shard_sequence, q, 2, 2)
    assert_raises_naming(ValueError, ["world_size", ">= 1", "0"], cp.simulate_ring_attention, q, kv, kv,
                         world_size=0)
    assert_raises_naming(ValueError, ["count", "'visible'"], cp.rank_work, 8, 2, count="blocks")
    # benchmark_steps read any sharding but "contiguous" as zigzag: it is checked before anything runs
    assert_raises_naming(ValueError, ["sharding", "'striped'"], cp.benchmark_steps, seqlen=64, world_size=2,
                         sharding="striped", device=device)


# -- on a CUDA GPU ----------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sharding,causal,window,head_dim", [("zigzag", True, (-1, -1), 128),
                                                              ("zigzag", False, (-1, -1), 64),
                                                              ("contiguous", True, (300, -1), 64)])
def test_gpu_simulated_ring(sharding, causal, window, head_dim, dtype):
    """The ring's pieces, merges and gradient accumulators on the GPU, 4 virtual ranks."""
    q = torch.randn(2, 1024, 8, head_dim, dtype=dtype, device="cuda", requires_grad=True)
    k, v = (torch.randn(2, 1024, 2, head_dim, dtype=dtype, device="cuda", requires_grad=True) for _ in range(2))
    out, lse = cp.simulate_ring_attention(q, k, v, world_size=4, causal=causal, window_size=window,
                                          sharding=sharding, return_lse=True)
    assert_matches_reference(out, lse, q.detach(), k.detach(), v.detach(), causal=causal, window_size=window)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert_grads_3x([q.grad, k.grad, v.grad], q.detach(), k.detach(), v.detach(), dout, causal, dtype,
                    window_size=window)


@gpu
def test_gpu_nccl_group_of_one(tmp_path):
    """ring_flash_attn_func and allgather_flash_attn_func on an NCCL group of one rank in this process."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        q, k, v = (torch.randn(1, 512, 4, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                   for _ in range(3))
        for fn in (cp.ring_flash_attn_func, cp.allgather_flash_attn_func):
            out, lse = fn(q, k, v, causal=True, return_lse=True)
            assert_matches_reference(out, lse, q.detach(), k.detach(), v.detach(), causal=True)
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            assert_grads_3x(grads, q.detach(), k.detach(), v.detach(), dout, True, torch.bfloat16)
    finally:
        dist.destroy_process_group()


@gpu
def test_gpu_timing_hook():
    """benchmark_steps (``python -m triflash.distributed``) runs and reports every step."""
    r = cp.benchmark_steps(seqlen=4096, world_size=4, heads=4, head_dim=64, backward=True)
    assert len(r["steps_ms"]) == 4 and r["dense_ms"] > 0 and r["ring_ms"] > 0
    assert r["step_bytes"] == 2 * 1024 * 4 * 64 * 2

