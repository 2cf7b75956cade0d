"""Local (sliding-window) attention: window_size=(left, right) in flash_attn_func, attention and
flash_attn_varlen_func, forward and backward, against the float64 reference with the same window
(helpers' 2x / 3x rules). Windows run on the Triton kernels everywhere and, on sm_90 at head dims 64
and 128, on the Gluon forward, dK/dV and dQ kernels (each variant forced below); the interpreter's
tiles (64 x 32) and the GPU's are both crossed by these sizes, so each of the three key ranges
(masked left edge, whole blocks, masked right edge) and the rows that see no key occur."""

import pytest
import torch
from conftest import DTYPES, ON_GPU
from helpers import (
    DTYPE_ID,
    assert_20_backward_passes_equal,
    assert_grads_3x,
    assert_matches_reference,
    assert_packed_grads_3x,
    assert_packed_matches_reference,
    assert_raises_naming,
    make_qkv,
    sequence_slices,
)

import triflash

WINDOWS = [(16, -1), (0, 0), (33, 5), (-1, 7), (100, 100), (0, -1), (200, 3)]
SEQLENS = [(130, 130), (50, 170), (170, 40), (1, 200)]


def _cases():
    cases = []
    for i, ((sq, sk), window, causal) in enumerate(
            (s, w, c) for s in SEQLENS for w in WINDOWS for c in (False, True)):
        if causal and window[1] > 0:
            continue                                   # rejected with causal (tested below)
        dtypes = DTYPES if ON_GPU else [DTYPES[i % len(DTYPES)]]
        for dtype in dtypes:
            cases.append(pytest.param(sq, sk, window, causal, dtype,
                                      id=f"Sq{sq}-Sk{sk}-w{window[0]}_{window[1]}-"
                                         f"{'causal' if causal else 'full'}-{DTYPE_ID[dtype]}"))
    return cases


@pytest.mark.parametrize("seqlen_q,seqlen_k,window,causal,dtype", _cases())
def test_window_forward_and_backward(device, seqlen_q, seqlen_k, window, causal, dtype):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 32 if not ON_GPU else 64, dtype, device, requires_grad=True)
    out, lse = triflash.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    assert_matches_reference(out, lse, q, k, v, causal=causal, window_size=window)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_3x(grads, q, k, v, dout, causal, dtype, window_size=window)


def test_unbounded_window_is_the_plain_kernel(device):
    """(-1, -1), and (-1, 0) with or without causal (both are causal attention), are the plain calls:
    the same bits, forward and backward."""
    q, k, v = make_qkv(1, 70, 90, 2, 1, 32, torch.float16, device, requires_grad=True)
    assert torch.equal(triflash.flash_attn_func(q, k, v, window_size=(-1, -1)), triflash.flash_attn_func(q, k, v))
    causal = triflash.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(causal)
    grads = torch.autograd.grad(causal, (q, k, v), dout)
    for kwargs in (dict(causal=True, window_size=(-1, 0)), dict(window_size=(-1, 0))):
        out = triflash.flash_attn_func(q, k, v, **kwargs)
        assert torch.equal(out, causal)
        for g, g2 in zip(grads, torch.autograd.grad(out, (q, k, v), dout)):
            assert torch.equal(g, g2)


def test_window_in_the_seeds_layout(device):
    q, k, v = make_qkv(2, 64, 80, 4, 2, 32, torch.float16, device)
    out = triflash.flash_attn_func(q, k, v, causal=True, window_size=(20, 0))
    out_bhsd = triflash.attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, window_size=(20, 0))
    assert torch.equal(out_bhsd, out.transpose(1, 2))


def test_window_on_packed_sequences(device):
    """A window over packed sequences (with one that has no queries and one short of keys): each
    sequence's out, lse and gradients against its own float64 reference, zeros for the empty one, and
    on the CPU the same bits as the sequence run alone (the same kernel and tiles)."""
    lengths = [(70, 70), (0, 5), (33, 90), (5, 1)]
    lq, lk = zip(*lengths)
    cu = [torch.tensor([0] + torch.tensor(x).cumsum(0).tolist(), dtype=torch.int32, device=device) for x in (lq, lk)]
    q = torch.randn(sum(lq), 4, 32, dtype=torch.float16, device=device, requires_grad=True)
    k = torch.randn(sum(lk), 2, 32, dtype=torch.float16, device=device, requires_grad=True)
    v = torch.randn(sum(lk), 2, 32, dtype=torch.float16, device=device, requires_grad=True)
    out, lse = triflash.flash_attn_varlen_func(q, k, v, *cu, max(lq), max(lk), causal=True, window_size=(12, 0),
                                               return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    assert_packed_matches_reference(out, lse, qd, kd, vd, *cu, True, window_size=(12, 0))
    assert_packed_grads_3x(grads, qd, kd, vd, dout, *cu, True, torch.float16, window_size=(12, 0))
    if not ON_GPU:
        for rows, keys in sequence_slices(*cu):
            if rows.stop > rows.start and keys.stop > keys.start:
                dense = triflash.flash_attn_func(qd[None, rows], kd[None, keys], vd[None, keys], causal=True,
                                                 window_size=(12, 0))
                assert torch.equal(out[rows], dense[0])


@pytest.mark.skipif(not ON_GPU, reason="the interpreter runs a grid's programs one after another: only a "
                                         "GPU can tell")
def test_window_backward_is_deterministic(device):
    q, k, v = make_qkv(2, 1024, 1024, 6, 2, 64, torch.float16, device, requires_grad=True)
    assert_20_backward_passes_equal(triflash.flash_attn_func(q, k, v, causal=True, window_size=(256, 0)), (q, k, v))


def test_huge_windows_are_unbounded(device):
    """Bounds far past the sequences (here near int32's limit, where the kernels' sums of bounds and
    positions would wrap) behave as unbounded: the same bits as the window cut to the lengths."""
    q, k, v = make_qkv(1, 30, 50, 2, 1, 32, torch.float16, device)
    for huge, cut in (((2**31 - 1, -1), (80, -1)), ((-1, 2**31 - 1), (-1, 80)), ((2**31 - 2, 2**31 - 2), (80, 80))):
        out, lse = triflash.flash_attn_func(q, k, v, window_size=huge, return_lse=True)
        assert torch.equal(out, triflash.flash_attn_func(q, k, v, window_size=cut))
        assert_matches_reference(out, lse, q, k, v)                  # every key, as with no window
    assert torch.equal(triflash.flash_attn_func(q, k, v, causal=True, window_size=(2**31 - 1, 0)),
                       triflash.flash_attn_func(q, k, v, causal=True))


@pytest.mark.skipif(not __import__("triflash.kernels.configs", fromlist=["x"]).gluon_available(),
                    reason="this Triton has no Gluon (the Hopper launchers import it)")
def test_the_fused_gluon_variant_given_with_a_window_is_not_taken(device, monkeypatch):
    """backward(..., variant="split") with a window runs the Triton kernels (the fused Gluon kernel's dQ
    turns follow the causal walk: no windows): the same bits as the Triton kernels forced. The Gluon
    kernel is made to look supported (as on an sm_90 GPU) and fails the test if it is launched."""
    from triflash.kernels import backward_hopper
    from triflash.kernels.dispatch import backward, forward

    q, k, v = make_qkv(1, 40, 40, 2, 1, 64, torch.float16, device)
    out, lse = forward(q, k, v, 0.125, True, window=(8, 0), variant="triton")
    dout = torch.randn_like(out)
    plain = backward(dout, q, k, v, out, lse, 0.125, True, window=(8, 0), variant="triton")
    monkeypatch.setattr(backward_hopper, "supported", lambda *args: True)
    monkeypatch.setattr(backward_hopper, "backward_hopper",
                        lambda *a, **kw: pytest.fail("the fused Gluon backward ran with a window"))
    forced = backward(dout, q, k, v, out, lse, 0.125, True, window=(8, 0), variant="split")
    for a, b in zip(plain, forced):
        assert torch.equal(a, b)


# On sm_90 at head dims 64 and 128 (fp16/bf16) windows run on the Gluon kernels: each forward variant
# the chooser can take and each dK/dV variant (with its dQ kernel), forced, at lengths that cross the
# 128- and 192-row query tiles and the 128-key blocks: left and right edges, causal with a left edge,
# Sq != Sk both ways, one query row, a diagonal-only window, and rows that see no key.
HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
HOPPER_SHAPES = [(700, 700, (256, 0), True), (500, 900, (100, 37), False), (900, 500, (300, -1), False),
                 (333, 333, (-1, 50), False), (1, 600, (64, 0), True), (640, 640, (0, 0), False),
                 (400, 150, (20, 20), False)]


def _hopper_cases():
    from triflash.kernels import configs, dispatch

    cases = []
    for head_dim, dtype in ((64, torch.float16), (64, torch.bfloat16), (128, torch.float16), (128, torch.bfloat16)):
        if not (HOPPER and configs.gluon_hopper_applies(head_dim=head_dim, dtype=dtype, device="cuda")):
            continue
        kinds = [("forward", g) for g in dispatch.forward_candidates(head_dim, dtype)]
        kinds += [("backward", g) for g in dispatch.backward_candidates(head_dim, one_pass=False)]
        for kind, gluon in kinds:
            shapes = [(*shape, False) for shape in HOPPER_SHAPES] + [(*shape, True) for shape in HOPPER_SHAPES[:2]]
            for sq, sk, window, causal, scores in shapes:
                cases.append(pytest.param(kind, gluon, sq, sk, window, causal, head_dim, dtype, scores,
                                          id=f"{kind}-{gluon}-Sq{sq}-Sk{sk}-w{window[0]}_{window[1]}-"
                                             f"{'causal' if causal else 'full'}-D{head_dim}-{DTYPE_ID[dtype]}"
                                             + ("-softcap_alibi" if scores else "")))
    return cases


HOPPER_CASES = _hopper_cases() or [
    pytest.param(*[None] * 9, marks=pytest.mark.skip(reason="needs an sm_90 GPU (Gluon kernels)"))]


@pytest.mark.parametrize("kind,gluon,seqlen_q,seqlen_k,window,causal,head_dim,dtype,scores", HOPPER_CASES)
def test_hopper_kernels_with_windows(device, force_kernels, monkeypatch, kind, gluon, seqlen_q, seqlen_k, window,
                                     causal, head_dim, dtype, scores):
    """Each Gluon forward or backward variant, forced, with a window (and on two shapes with softcap
    and [B, H] ALiBi slopes too, ``scores``): out and lse under the 2x rule, gradients under the 3x
    rule (a gradient on the lse too), and the forced kernel is the one that ran, with the window."""
    from triflash.kernels import backward_hopper, forward_hopper

    module = forward_hopper if kind == "forward" else backward_hopper
    entry = f"{kind}_hopper"
    taken = []
    real = getattr(module, entry)
    monkeypatch.setattr(module, entry,
                        lambda *a, **kw: taken.append((kw["variant"], kw.get("window"))) or real(*a, **kw))
    force_kernels(**{kind: gluon})
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, dtype, device, requires_grad=True)
    variants = dict(softcap=5.0, alibi_slopes=torch.rand(2, 4, device=device)) if scores else {}
    out, lse = triflash.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True, **variants)
    assert_matches_reference(out, lse, q, k, v, causal=causal, window_size=window, **variants)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert_grads_3x(grads, q, k, v, dout, causal, dtype, dlse, None, window, **variants)
    assert [t[0] for t in taken] == [gluon] and taken[0][1] is not None


def test_window_size_is_checked(device):
    q, k, v = make_qkv(1, 8, 8, 2, 1, 16, torch.float16, device)
    f = triflash.flash_attn_func
    assert_raises_naming(TypeError, ["window_size", "pair of ints", "8"], f, q, k, v, window_size=8)
    assert_raises_naming(TypeError, ["window_size", "pair of ints"], f, q, k, v, window_size=(1.0, 2))
    assert_raises_naming(ValueError, ["window_size", ">= -1", "-2"], f, q, k, v, window_size=(-2, 0))
    assert_raises_naming(ValueError, ["window_size[1]", "causal=True", "3"], f, q, k, v, causal=True,
                         window_size=(4, 3))
