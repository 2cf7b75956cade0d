"""Row offsets past 2^31 elements inside one (batch, head).

The pointer-loading Triton kernels form a (batch, head)'s base offset in int64 and the offset inside
it, row * row stride + lane, in int32 unless their LONG flag is set, which the launchers set when
``common.needs_int64_rows`` says that offset can pass 2^31 - 1 (FlashAttention's layout: S * H * D
elements, e.g. 512k rows of 32 heads x 128 lanes). On the CPU the flag is forced on small inputs (the
same bits as without it); on the GPU real sizes cross the boundary.
"""

import pytest
import torch
from conftest import ON_GPU
from helpers import FLOOR, assert_matches_reference, max_err, relative

import triflash
from triflash.kernels import backward as B
from triflash.kernels import configs, dispatch
from triflash.kernels import forward as F
from triflash.kernels.common import Varlen, needs_int64_rows
from triflash.reference import flash_attn_ref


def test_needs_int64_rows_at_the_boundary():
    meta = dict(device="meta", dtype=torch.float16)
    # (S - 1) * H * D + D against 2^31 - 1, at 32 heads of 128 lanes: 2^19 rows fit, 2^19 + 1 do not.
    assert not needs_int64_rows(torch.empty(1, 2**19, 32, 128, **meta))
    assert needs_int64_rows(torch.empty(1, 2**19 + 1, 32, 128, **meta))
    # The seeds' layout seen as [B, S, H, D]: the row stride is D, so far from the boundary.
    assert not needs_int64_rows(torch.empty(1, 32, 2**19 + 1, 128, **meta).transpose(1, 2))
    # Packed sequences [total, H, D]; any argument that needs it decides; descriptors are skipped.
    assert needs_int64_rows(object(), torch.empty(2**19 + 1, 32, 128, **meta))
    assert not needs_int64_rows(torch.empty(0, 32, 128, **meta), torch.empty(7, 1, 1, **meta))


class _Spy:
    """Wraps a @triton.jit kernel: records the LONG flag of every launch."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append(kwargs.get("LONG"))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forced_int64_offsets_give_the_same_bits(device, monkeypatch, causal, varlen):
    """The LONG code path (forced) against the usual one: forward and backward, bit for bit. The
    Triton kernels are forced too (explicit configs), so on Hopper this is still the pointer path."""
    torch.manual_seed(0)
    dtype = torch.float16
    fwd_cfg = configs.FwdConfig(64, 64, 4, 2, tma="none")
    bwd_cfg = configs.backward_config(head_dim=64, dtype=dtype, device=device)
    if varlen:
        lengths = [70, 0, 33]
        cu = torch.tensor([0, 70, 70, 103], dtype=torch.int32, device=device)
        shape_q, shape_kv = (103, 4, 64), (103, 2, 64)
        kw = dict(varlen=Varlen(cu, cu, max(lengths), max(lengths)))
    else:
        shape_q, shape_kv = (2, 70, 4, 64), (2, 90, 2, 64)
        kw = {}
    q = torch.randn(shape_q, dtype=dtype, device=device)
    k, v = (torch.randn(shape_kv, dtype=dtype, device=device) for _ in range(2))
    dout = torch.randn_like(q)

    def run():
        out, lse = dispatch.forward(q, k, v, 0.125, causal, config=fwd_cfg, **kw)
        grads = dispatch.backward(dout, q, k, v, out, lse, 0.125, causal, config=bwd_cfg, **kw)
        return (out, lse, *grads)

    plain = run()
    seen = []
    for mod, name in ((F, "_attn_fwd_kernel"), (B, "_bwd_preprocess_kernel"), (B, "_bwd_dkdv_kernel"),
                      (B, "_bwd_dq_kernel")):
        monkeypatch.setattr(mod, name, _Spy(getattr(mod, name), seen))
        monkeypatch.setattr(mod, "needs_int64_rows", lambda *tensors: True)
    wide = run()
    assert seen == [True] * 4
    for a, b in zip(plain, wide):
        assert torch.equal(a, b)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_forced_int64_offsets_in_decode(device, monkeypatch, num_splits):
    """Decode's LONG form (q's and out's rows in int64) against the usual one, bit for bit."""
    from triflash.kernels import decode as DEC

    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, 64, dtype=torch.float16, device=device)
    cache = torch.randn(2, 100, 2, 64, dtype=torch.float16, device=device)
    lengths = torch.tensor([100, 37], dtype=torch.int32, device=device)
    cfg = configs.DecodeConfig(block_m=16, block_n=32, num_warps=4, num_stages=2, num_splits=num_splits)

    def run():
        return dispatch.decode(q, cache, cache, lengths, None, 0, 100, 0.125, True, config=cfg)
    plain = run()
    seen = []
    monkeypatch.setattr(DEC, "_decode_kernel", _Spy(DEC._decode_kernel, seen))
    monkeypatch.setattr(DEC, "needs_int64_rows", lambda *tensors: True)
    wide = run()
    assert seen == [True]
    for a, b in zip(plain, wide):
        assert torch.equal(a, b)


# -- real sizes (GPU) ------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not ON_GPU, reason="tensors of 4 GiB and more: GPU only")


@needs_gpu
@pytest.mark.parametrize("tma", ["chooser", "none"], ids=["chosen-kernel", "pointer-loads"])
def test_keys_past_2_31_elements_in_one_head(tma):
    """k, v [1, 2^20 + 64, 8, 256] (4 GiB each): the last keys sit past 2^31 elements of their head's
    first one. A few queries, so the kernel is quick. Checked against the reference, and bit for bit
    against the same data in the seeds' layout (row stride 256: no 64-bit offsets needed), on the
    kernel the launcher chooses (on Hopper, TMA descriptors) and on the Triton kernel's pointer loads."""
    torch.manual_seed(0)
    sk, hkv, d = 2**20 + 64, 8, 256
    k = torch.randn(1, sk, hkv, d, dtype=torch.float16, device="cuda")
    v = torch.randn(1, sk, hkv, d, dtype=torch.float16, device="cuda")
    q = torch.randn(1, 16, hkv, d, dtype=torch.float16, device="cuda")
    k_bhsd, v_bhsd = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    assert needs_int64_rows(k) and not needs_int64_rows(k_bhsd)
    config = None if tma == "chooser" else configs.FwdConfig(64, 64, 4, 2, tma="none")
    for causal in (False, True):
        out, lse = dispatch.forward(q, k, v, d ** -0.5, causal, config=config)
        assert_matches_reference(out, lse, q, k, v, causal=causal)
        out2, lse2 = dispatch.forward(q, k_bhsd, v_bhsd, d ** -0.5, causal, config=config)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)


@needs_gpu
def test_queries_past_2_31_elements_in_one_head_backward():
    """q, dout [1, 2^18 + 64, 32, 256] (4 GiB each) against 16 keys: forward and backward (the
    preprocess reads out and dout rows, the dQ kernel q and dout rows, past 2^31 elements), bit for bit
    against the same data in the seeds' layout, and the last rows' dq against the reference by the
    backward's 3x rule."""
    torch.manual_seed(0)
    sq, hq, d = 2**18 + 64, 32, 256
    q = torch.randn(1, sq, hq, d, dtype=torch.float16, device="cuda", requires_grad=True)
    k = torch.randn(1, 16, 1, d, dtype=torch.float16, device="cuda", requires_grad=True)
    v = torch.randn(1, 16, 1, d, dtype=torch.float16, device="cuda", requires_grad=True)
    dout = torch.randn(1, sq, hq, d, dtype=torch.float16, device="cuda")
    assert needs_int64_rows(q)
    out = triflash.flash_attn_func(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q2 = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert not needs_int64_rows(q2)
    out2 = triflash.flash_attn_func(q2, k, v)
    grads2 = torch.autograd.grad(out2, (q2, k, v), dout.transpose(1, 2).contiguous().transpose(1, 2))
    assert torch.equal(out, out2)
    for g, g2 in zip(grads, grads2):
        assert torch.equal(g, g2)
    tail = slice(sq - 128, sq)

    def tail_dq(compute):
        """dq of the last rows by the reference: float64, or None for PyTorch's own fp16 attention."""
        leaves = [t.detach()[:, tail] if t is q else t.detach() for t in (q, k, v)]
        leaves = [(t.to(compute) if compute else t).requires_grad_() for t in leaves]
        flash_attn_ref(*leaves, compute_dtype=compute).backward(dout[:, tail].to(leaves[0].dtype))
        return leaves[0].grad
    ref, same = tail_dq(torch.float64), tail_dq(None)
    err, base = max_err(grads[0][:, tail], ref), max_err(same, ref)
    assert err <= 3 * base + relative(FLOOR[torch.float16], ref)
