"""Bad input raises TypeError/ValueError before any launch, naming the argument, expected and received."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import assert_raises_naming

import triflash
import triflash.autograd
import triflash.kernels.dispatch


def _qkv(device, b=1, sq=8, sk=8, hq=4, hkv=2, d=32, dtype=torch.float16):
    q = torch.randn(b, sq, hq, d, dtype=dtype, device=device)
    k = torch.randn(b, sk, hkv, d, dtype=dtype, device=device)
    v = torch.randn(b, sk, hkv, d, dtype=dtype, device=device)
    return q, k, v


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if validation lets a bad input reach the kernel launcher."""
    def boom(*args, **kwargs):
        raise AssertionError("the kernel was launched before the bad input was rejected")
    monkeypatch.setattr(triflash.kernels.dispatch, "forward", boom)


def _bad_inputs(device):
    q, k, v = _qkv(device)
    return [
        ("rank", (q[0], k, v), {}, ValueError, ["q must", "4-D", "3-D"]),
        ("rank-k", (q, k[..., None], v), {}, ValueError, ["k must", "4-D", "5-D"]),
        ("not-a-tensor", (q.tolist(), k, v), {}, TypeError, ["q must", "torch.Tensor", "list"]),
        ("dtype-mismatch", (q, k.float(), v), {}, TypeError, ["k.dtype", "torch.float16", "torch.float32"]),
        ("dtype-mismatch-v", (q, k, v.to(torch.bfloat16)), {}, TypeError, ["v.dtype", "torch.bfloat16"]),
        ("unsupported-dtype", (q.double(), k.double(), v.double()), {}, TypeError,
         ["q.dtype", "float16, bfloat16, float32", "torch.float64"]),
        ("int-dtype", (q.to(torch.int32), k.to(torch.int32), v.to(torch.int32)), {}, TypeError,
         ["q.dtype", "torch.int32"]),
        ("heads-not-multiple", _qkv(device, hq=6, hkv=4), {}, ValueError, ["multiple", "Hq=6", "Hkv=4"]),
        ("head-dim-differs", (q, torch.randn(1, 8, 2, 16, dtype=q.dtype, device=device),
                              torch.randn(1, 8, 2, 16, dtype=q.dtype, device=device)), {}, ValueError,
         ["head_dim", "32", "16"]),
        ("head-dim-too-big", _qkv(device, d=272), {}, ValueError, ["head_dim", "256", "272"]),
        ("kv-shapes-differ", (q, k, v[:, :5]), {}, ValueError, ["v must", "same shape as k", "(1, 8, 2, 32)",
                                                               "(1, 5, 2, 32)"]),
        ("batch-mismatch", (q, torch.cat([k, k]), torch.cat([v, v])), {}, ValueError, ["k and v", "batch", "1", "2"]),
        ("scale-type", (q, k, v), {"softmax_scale": "0.1"}, TypeError, ["softmax_scale", "str"]),
        ("scale-nan", (q, k, v), {"softmax_scale": float("nan")}, ValueError, ["softmax_scale", "nan"]),
        ("scale-negative", (q, k, v), {"softmax_scale": -1.0}, ValueError, ["softmax_scale", "-1.0"]),
        ("causal-type", (q, k, v), {"causal": "yes"}, TypeError, ["causal", "bool", "str"]),
        ("return-lse-type", (q, k, v), {"return_lse": 1}, TypeError, ["return_lse", "bool", "int"]),
        # The kernels use the scale in float32: one that is inf or 0 there would give NaN.
        ("causal-numpy-bool", (q, k, v), {"causal": np.bool_(True)}, TypeError, ["causal", "bool", "numpy."]),
        ("scale-huge", (q, k, v), {"softmax_scale": 3e38}, ValueError, ["softmax_scale", "2^127", "3e+38"]),
        ("scale-tiny", (q, k, v), {"softmax_scale": 1e-46}, ValueError, ["softmax_scale", "2^-126", "1e-46"]),
        ("scale-beyond-float", (q, k, v), {"softmax_scale": 10**400}, ValueError, ["softmax_scale", "finite"]),
    ]


BAD_IDS = [case[0] for case in _bad_inputs("cpu")]


@pytest.mark.parametrize("case_id", BAD_IDS)
def test_bad_input_raises_before_launch(device, no_launch, case_id):
    _, args, kwargs, exc, words = next(c for c in _bad_inputs(device) if c[0] == case_id)
    assert_raises_naming(exc, words, triflash.flash_attn_func, *args, **kwargs)


def test_bhsd_api_names_its_own_layout_and_scale(device, no_launch):
    q = torch.randn(1, 4, 8, 32, dtype=torch.float16, device=device)
    k = torch.randn(1, 3, 8, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"Hq=4, Hkv=3"):
        triflash.attention(q, k, k)
    with pytest.raises(ValueError, match=r"\[batch, heads, seqlen, head_dim\]"):
        triflash.attention(q[0], k, k)
    with pytest.raises(ValueError, match="sm_scale"):
        triflash.attention(q, q, q, sm_scale=0.0)


def test_tensors_on_different_devices(no_launch):
    """The meta device stands in for a second device: the check compares devices before anything else."""
    q, k, v = _qkv("cpu")
    with pytest.raises(ValueError, match=r"k must be on the same device as q \(cpu\), got meta"):
        triflash.flash_attn_func(q, k.to("meta"), v)
    with pytest.raises(ValueError, match=r"v must be on the same device as q"):
        triflash.flash_attn_func(q, k, v.to("meta"))


def test_cpu_tensors_without_interpreter_ask_for_a_gpu(tmp_path):
    """Without TRITON_INTERPRET=1, CPU tensors get a clear 'needs a CUDA GPU' error."""
    code = (
        "import torch, triflash\n"
        "q = torch.randn(1, 4, 1, 16, dtype=torch.float16)\n"
        "try:\n"
        "    triflash.flash_attn_func(q, q, q)\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "ERR" in res.stdout and "CUDA GPU" in res.stdout and "TRITON_INTERPRET=1" in res.stdout


def test_options_are_keyword_only(device, no_launch):
    """A ported FlashAttention 2 call, flash_attn_func(q, k, v, 0.1, causal=True), would read 0.1 (FA2's
    dropout_p) as the softmax scale: every option after q, k, v is keyword-only, and the error says why."""
    q, k, v = _qkv(device)
    assert_raises_naming(TypeError, ["flash_attn_func", "keyword", "dropout_p", "1 more positional"],
                         triflash.flash_attn_func, q, k, v, 0.1, causal=True)
    assert_raises_naming(TypeError, ["attention", "keyword", "2 more positional"],
                         triflash.attention, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True, 0.5)


def test_dropout_p_is_accepted_only_as_zero(device, no_launch):
    q, k, v = _qkv(device)
    f = triflash.flash_attn_func
    assert_raises_naming(ValueError, ["dropout_p", "0.0", "no attention dropout", "0.1"], f, q, k, v, dropout_p=0.1)
    assert_raises_naming(TypeError, ["dropout_p", "number", "bool"], f, q, k, v, dropout_p=False)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    assert_raises_naming(ValueError, ["dropout_p", "0.0"], triflash.flash_attn_varlen_func, q[0], k[0], v[0], cu, cu,
                         8, 8, dropout_p=0.5)


def test_dropout_p_zero_is_plain_attention(device):
    q, k, v = _qkv(device)
    want = triflash.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(triflash.flash_attn_func(q, k, v, causal=True, dropout_p=0.0), want)
    assert torch.equal(triflash.flash_attn_func(q, k, v, causal=True, dropout_p=0), want)
