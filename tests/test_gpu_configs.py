"""Config choices for every NVIDIA GPU Triton supports (sm_80, 86, 89, 90, 100, 120) and for AMD, on
the CPU: each choice fits the GPU's shared memory per block, the choice follows the device's
properties (not only its major version), AMD never gets the NVIDIA-only paths (Gluon, TMA), and on
the GPUs the tables were measured on (H100, H200) every choice is what it was before other GPUs were
handled.

Shared memory is estimated (``configs.forward_shared_bytes`` and friends), not compiled: a compile
per config takes seconds. ``COMPILED_SHARED`` holds what scripts/compile_check.py reported as the
compiled kernels' ``metadata.shared``; the estimates must be at or above it, so a choice the
estimate fits also fits when compiled. scripts/compile_check.py --quick compiles every choice for
every target (CI) and fails on one that does not fit.
"""

import types

import pytest
import torch

from triflash.kernels import configs, dispatch
from triflash.kernels.configs import BwdConfig, DeviceFacts, FwdConfig

# What each GPU reports (torch.cuda.get_device_properties): capability, SMs, shared memory per block
# (opt-in). ROCm's torch reports gfx90a as 9.0 and gfx942 as 9.4.
GPUS = {
    "A100 (sm_80)": DeviceFacts(8, 0, 108, 166912),
    "RTX 3090 / A10 (sm_86)": DeviceFacts(8, 6, 82, 101376),
    "RTX 4090 / L4 (sm_89)": DeviceFacts(8, 9, 128, 101376),
    "L4 (sm_89, 58 SMs)": DeviceFacts(8, 9, 58, 101376),
    "H100 (sm_90)": DeviceFacts(9, 0, 132, 232448),
    "H100 PCIe (sm_90)": DeviceFacts(9, 0, 114, 232448),
    "B200 (sm_100)": DeviceFacts(10, 0, 148, 232448),
    "RTX 5090 (sm_120)": DeviceFacts(12, 0, 170, 101376),
    "MI250X (gfx90a)": DeviceFacts(9, 0, 110, 65536, is_hip=True),
    "MI300X (gfx942)": DeviceFacts(9, 4, 304, 65536, is_hip=True),
    "MI355X (gfx950)": DeviceFacts(9, 5, 256, 163840, is_hip=True),
}
HIP = [name for name, f in GPUS.items() if f.is_hip]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.fixture(autouse=True)
def compiled_mode(monkeypatch):
    """The choosers as on a GPU: the suite runs under TRITON_INTERPRET=1, where they return the
    interpreter's small configs."""
    monkeypatch.setattr(configs, "INTERPRET", False)
    configs.clear_device_cache()
    yield
    configs.clear_device_cache()


def fwd(facts, d, dtype, causal=False, bh=64, sq=4096):
    return configs.forward_config(head_dim=d, dtype=dtype, causal=causal, batch_heads=bh, seqlen_q=sq, device=facts)


def dec(facts, d, dtype, batch, paged=False, page=None, rows=4, max_seqlen=8192, gluon=None):
    return configs.decode_config(head_dim=d, dtype=dtype, rows=rows, batch=batch, heads_kv=8, max_seqlen=max_seqlen,
                                 num_splits=0, paged=paged, device=facts, page_size=page, gluon_suits=gluon)


# --------------------------------------------------------------------------------------------------
# Every choice fits
# --------------------------------------------------------------------------------------------------

def _fits_everywhere_cases():
    for name, facts in GPUS.items():
        for dtype in DTYPES.values():
            for d in (32, 64, 96, 128, 256):
                if facts.shared_per_block < 100000 and dtype == torch.float32 and d == 256:
                    continue          # no backward tile fits 64 KB: test_clear_error_where_nothing_fits
                yield pytest.param(facts, d, dtype, id=f"{name}-{str(dtype)[6:]}-D{d}")


@pytest.mark.parametrize("facts,d,dtype", list(_fits_everywhere_cases()))
def test_choices_fit_shared_memory(facts, d, dtype):
    block_d = configs.head_dim_block(d)
    elt = dtype.itemsize
    limit = facts.shared_per_block
    for causal in (False, True):
        for bh, sq in ((1, 128), (8, 512), (64, 1024), (32, 2048), (16, 4096), (4, 65536)):
            cfg = fwd(facts, d, dtype, causal, bh, sq)
            assert configs.forward_shared_bytes(cfg, block_d=block_d, elt=elt) <= limit, cfg
            assert cfg.tma == "none" or facts.tma
            assert min(cfg.block_m, cfg.block_n) >= 16 and cfg.num_stages >= 1
    dkdv, dq = configs.backward_config(head_dim=d, dtype=dtype, device=facts)
    assert configs.backward_shared_bytes(dkdv, kept="block_n", block_d=block_d, elt=elt) <= limit
    assert configs.backward_shared_bytes(dq, kept="block_m", block_d=block_d, elt=elt) <= limit
    assert not (dkdv.tma or dq.tma) or facts.tma
    for batch in (1, 4, 16, 64, 256):
        for paged, page in ((False, None), (True, 16), (True, 5), (True, 256)):
            for rows in (1, 4, 8, 64):
                cfg = dec(facts, d, dtype, batch, paged, page, rows)
                tile = configs._DecodeTile(cfg.block_n, cfg.num_warps, cfg.num_stages, 1)
                assert configs.decode_shared_bytes(tile, block_m=cfg.block_m, paged=paged, block_d=block_d,
                                                   elt=elt) <= limit, cfg
                assert cfg.kernel == "triton"      # gluon_suits=None


@pytest.mark.parametrize("name", ["RTX 3090 / A10 (sm_86)", "RTX 4090 / L4 (sm_89)", "RTX 5090 (sm_120)"])
def test_d128_forward_fits_99kb_gpus(name):
    """Issue 30: with the H200's choice (128x128 tiles, 3 stages), the D=128 forward compiled for
    sm_86 needs 163840 B of shared memory, above the 101376 B of sm_86/89/120."""
    facts = GPUS[name]
    h200 = fwd(configs.H200, 128, torch.float16)
    assert (h200.block_m, h200.block_n, h200.num_stages) == (128, 128, 3)
    cfg = fwd(facts, 128, torch.float16)
    assert cfg != h200
    assert configs.forward_shared_bytes(cfg, block_d=128, elt=2) <= 101376


# --------------------------------------------------------------------------------------------------
# The estimates against compiled kernels
# --------------------------------------------------------------------------------------------------

# metadata.shared of the kernels scripts/compile_check.py --quick compiled (Triton 3.6) for the
# choosers' picks: (target, kernel, dtype, head dim block, (block_m, block_n, num_warps, num_stages,
# tma)) -> bytes. Regenerate after changing a chooser or a kernel's tiles.
COMPILED_SHARED = {
    ('80', 'fwd', 'fp16', 64, (128, 64, 4, 3, False)): 49152,
    ('80', 'fwd', 'fp16', 64, (64, 64, 4, 3, False)): 40960,
    ('80', 'fwd', 'fp16', 128, (128, 128, 8, 3, False)): 163840,
    ('80', 'fwd', 'fp16', 128, (64, 64, 4, 3, False)): 90112,
    ('80', 'fwd', 'fp16', 256, (64, 64, 4, 2, False)): 106496,
    ('80', 'fwd', 'fp32', 64, (64, 32, 4, 2, False)): 41216,
    ('80', 'fwd', 'fp32', 128, (32, 32, 4, 1, False)): 36864,
    ('80', 'fwd', 'fp32', 256, (32, 32, 4, 1, False)): 69632,
    ('80', 'dkdv', 'fp16', 64, (32, 128, 4, 3, False)): 49664,
    ('80', 'dq', 'fp16', 64, (64, 64, 4, 3, False)): 49152,
    ('80', 'dkdv', 'fp16', 128, (32, 64, 4, 3, False)): 70144,
    ('80', 'dq', 'fp16', 128, (64, 64, 4, 2, False)): 73728,
    ('80', 'dkdv', 'fp16', 256, (16, 64, 4, 1, False)): 90112,
    ('80', 'dq', 'fp16', 256, (64, 16, 4, 1, False)): 81920,
    ('80', 'dkdv', 'fp32', 64, (32, 32, 4, 1, False)): 36864,
    ('80', 'dq', 'fp32', 64, (32, 32, 4, 1, False)): 32768,
    ('80', 'dkdv', 'fp32', 128, (16, 32, 4, 1, False)): 51200,
    ('80', 'dq', 'fp32', 128, (32, 16, 4, 1, False)): 49152,
    ('80', 'dkdv', 'fp32', 256, (16, 32, 4, 1, False)): 100352,
    ('80', 'dq', 'fp32', 256, (32, 16, 4, 1, False)): 98304,
    ('80', 'decode', 'fp16', 128, (16, 64, 4, 2, False)): 38912,
    ('80', 'decode', 'fp16', 128, (16, 128, 4, 2, False)): 73728,
    ('80', 'decode-paged', 'fp16', 128, (16, 64, 4, 3, False)): 39424,
    ('80', 'decode-paged', 'fp16', 128, (16, 128, 4, 4, False)): 73760,
    ('80', 'decode-paged', 'fp16', 128, (16, 128, 4, 2, False)): 73728,
    ('80', 'decode', 'fp32', 128, (16, 32, 4, 2, False)): 49152,
    ('80', 'decode', 'fp16', 64, (16, 128, 4, 2, False)): 38912,
    ('80', 'decode', 'fp16', 64, (16, 256, 4, 2, False)): 75776,
    ('80', 'decode', 'fp16', 256, (16, 32, 4, 2, False)): 41984,
    ('86', 'fwd', 'fp16', 64, (128, 64, 4, 3, False)): 49152,
    ('86', 'fwd', 'fp16', 64, (64, 64, 4, 3, False)): 40960,
    ('86', 'fwd', 'fp16', 128, (128, 64, 8, 3, False)): 98304,
    ('86', 'fwd', 'fp16', 128, (64, 64, 4, 3, False)): 90112,
    ('86', 'fwd', 'fp16', 256, (64, 32, 4, 2, False)): 69632,
    ('86', 'fwd', 'fp32', 64, (64, 32, 4, 2, False)): 41216,
    ('86', 'fwd', 'fp32', 128, (32, 32, 4, 1, False)): 36864,
    ('86', 'fwd', 'fp32', 256, (32, 32, 4, 1, False)): 69632,
    ('86', 'dkdv', 'fp16', 64, (32, 128, 4, 3, False)): 49664,
    ('86', 'dq', 'fp16', 64, (64, 64, 4, 3, False)): 49152,
    ('86', 'dkdv', 'fp16', 128, (32, 64, 4, 3, False)): 70144,
    ('86', 'dq', 'fp16', 128, (64, 32, 4, 2, False)): 53248,
    ('86', 'dkdv', 'fp16', 256, (16, 64, 4, 1, False)): 90112,
    ('86', 'dq', 'fp16', 256, (64, 16, 4, 1, False)): 81920,
    ('86', 'dkdv', 'fp32', 64, (32, 32, 4, 1, False)): 36864,
    ('86', 'dq', 'fp32', 64, (32, 32, 4, 1, False)): 32768,
    ('86', 'dkdv', 'fp32', 128, (16, 32, 4, 1, False)): 51200,
    ('86', 'dq', 'fp32', 128, (32, 16, 4, 1, False)): 49152,
    ('86', 'dkdv', 'fp32', 256, (16, 32, 4, 1, False)): 100352,
    ('86', 'dq', 'fp32', 256, (32, 16, 4, 1, False)): 98304,
    ('86', 'decode', 'fp16', 128, (16, 64, 4, 2, False)): 38912,
    ('86', 'decode', 'fp16', 128, (16, 128, 4, 2, False)): 73728,
    ('86', 'decode-paged', 'fp16', 128, (16, 64, 4, 3, False)): 39424,
    ('86', 'decode-paged', 'fp16', 128, (16, 128, 4, 4, False)): 73760,
    ('86', 'decode-paged', 'fp16', 128, (16, 128, 4, 2, False)): 73728,
    ('86', 'decode', 'fp32', 128, (16, 32, 4, 2, False)): 49152,
    ('86', 'decode', 'fp16', 64, (16, 128, 4, 2, False)): 38912,
    ('86', 'decode', 'fp16', 64, (16, 256, 4, 2, False)): 75776,
    ('86', 'decode', 'fp16', 256, (16, 32, 4, 2, False)): 41984,
    ('89', 'fwd', 'fp16', 64, (128, 64, 4, 3, False)): 49152,
    ('89', 'fwd', 'fp16', 64, (64, 64, 4, 3, False)): 40960,
    ('89', 'fwd', 'fp16', 128, (128, 64, 8, 3, False)): 98304,
    ('89', 'fwd', 'fp16', 128, (64, 64, 4, 3, False)): 90112,
    ('89', 'fwd', 'fp16', 256, (64, 32, 4, 2, False)): 69632,
    ('89', 'fwd', 'fp32', 64, (64, 32, 4, 2, False)): 41216,
    ('89', 'fwd', 'fp32', 128, (32, 32, 4, 1, False)): 36864,
    ('89', 'fwd', 'fp32', 256, (32, 32, 4, 1, False)): 69632,
    ('89', 'dkdv', 'fp16', 64, (32, 128, 4, 3, False)): 49664,
    ('89', 'dq', 'fp16', 64, (64, 64, 4, 3, False)): 49152,
    ('89', 'dkdv', 'fp16', 128, (32, 64, 4, 3, False)): 70144,
    ('89', 'dq', 'fp16', 128, (64, 32, 4, 2, False)): 53248,
    ('89', 'dkdv', 'fp16', 256, (16, 64, 4, 1, False)): 90112,
    ('89', 'dq', 'fp16', 256, (64, 16, 4, 1, False)): 81920,
    ('89', 'dkdv', 'fp32', 64, (32, 32, 4, 1, False)): 36864,
    ('89', 'dq', 'fp32', 64, (32, 32, 4, 1, False)): 32768,
    ('89', 'dkdv', 'fp32', 128, (16, 32, 4, 1, False)): 51200,
    ('89', 'dq', 'fp32', 128, (32, 16, 4, 1, False)): 49152,
    ('89', 'dkdv', 'fp32', 256, (16, 32, 4, 1, False)): 100352,
    ('89', 'dq', 'fp32', 256, (32, 16, 4, 1, False)): 98304,
    ('89', 'decode', 'fp16', 128, (16, 64, 4, 2, False)): 38912,
    ('89', 'decode', 'fp16', 128, (16, 128, 4, 2, False)): 73728,
    ('89', 'decode-paged', 'fp16', 128, (16, 64, 4, 3, False)): 39424,
    ('89', 'decode-paged', 'fp16', 128, (16, 128, 4, 4, False)): 74240,
    ('89', 'decode', 'fp32', 128, (16, 32, 4, 2, False)): 49152,
    ('89', 'decode', 'fp16', 64, (16, 128, 4, 2, False)): 38912,
    ('89', 'decode', 'fp16', 64, (16, 256, 4, 2, False)): 75776,
    ('89', 'decode', 'fp16', 256, (16, 32, 4, 2, False)): 41984,
    ('90', 'fwd', 'fp16', 64, (128, 64, 4, 3, True)): 49208,
    ('90', 'fwd', 'fp16', 64, (64, 64, 4, 3, True)): 49208,
    ('90', 'fwd', 'fp16', 128, (128, 128, 8, 3, True)): 196664,
    ('90', 'fwd', 'fp16', 128, (64, 64, 4, 3, True)): 98360,
    ('90', 'fwd', 'fp16', 256, (64, 64, 4, 2, True)): 131104,
    ('90', 'fwd', 'fp32', 64, (64, 32, 4, 2, True)): 32792,
    ('90', 'fwd', 'fp32', 128, (32, 32, 4, 1, True)): 20496,
    ('90', 'fwd', 'fp32', 256, (32, 32, 4, 1, True)): 36880,
    ('90', 'dkdv', 'fp16', 64, (32, 128, 4, 3, False)): 57856,
    ('90', 'dq', 'fp16', 64, (64, 64, 4, 3, True)): 66560,
    ('90', 'dkdv', 'fp16', 128, (32, 64, 4, 3, False)): 82944,
    ('90', 'dq', 'fp16', 128, (64, 64, 4, 2, True)): 99328,
    ('90', 'dkdv', 'fp16', 256, (16, 64, 4, 1, False)): 81920,
    ('90', 'dq', 'fp16', 256, (64, 16, 4, 1, False)): 81920,
    ('90', 'dkdv', 'fp32', 64, (32, 32, 4, 1, False)): 36864,
    ('90', 'dq', 'fp32', 64, (32, 32, 4, 1, False)): 32768,
    ('90', 'dkdv', 'fp32', 128, (16, 32, 4, 1, False)): 51200,
    ('90', 'dq', 'fp32', 128, (32, 16, 4, 1, False)): 49152,
    ('90', 'dkdv', 'fp32', 256, (16, 32, 4, 1, False)): 100352,
    ('90', 'dq', 'fp32', 256, (32, 16, 4, 1, False)): 98304,
    ('90', 'decode', 'fp16', 128, (16, 64, 4, 2, False)): 38912,
    ('90', 'decode', 'fp16', 128, (16, 128, 4, 3, False)): 139264,
    ('90', 'decode-paged', 'fp16', 128, (16, 64, 4, 3, False)): 39424,
    ('90', 'decode-paged', 'fp16', 128, (16, 128, 4, 5, False)): 140288,
    ('90', 'decode', 'fp32', 128, (16, 32, 4, 2, False)): 49152,
    ('90', 'decode', 'fp16', 64, (16, 128, 4, 2, False)): 38912,
    ('90', 'decode', 'fp16', 64, (16, 256, 4, 3, False)): 141312,
    ('90', 'decode', 'fp16', 256, (16, 32, 4, 2, False)): 41984,
    ('100', 'fwd', 'fp16', 64, (128, 64, 4, 3, True)): 66560,
    ('100', 'fwd', 'fp16', 64, (64, 64, 4, 3, True)): 58368,
    ('100', 'fwd', 'fp16', 128, (128, 128, 8, 3, True)): 230400,
    ('100', 'fwd', 'fp16', 128, (64, 64, 4, 3, True)): 115712,
    ('100', 'fwd', 'fp16', 256, (64, 64, 4, 2, True)): 164864,
    ('100', 'fwd', 'fp32', 64, (64, 32, 4, 2, True)): 32792,
    ('100', 'fwd', 'fp32', 128, (32, 32, 4, 1, True)): 20496,
    ('100', 'fwd', 'fp32', 256, (32, 32, 4, 1, True)): 36880,
    ('100', 'dkdv', 'fp16', 64, (32, 128, 4, 3, False)): 66112,
    ('100', 'dq', 'fp16', 64, (64, 64, 4, 3, True)): 74752,
    ('100', 'dkdv', 'fp16', 128, (32, 64, 4, 3, False)): 99328,
    ('100', 'dq', 'fp16', 128, (64, 64, 4, 2, True)): 115712,
    ('100', 'dkdv', 'fp16', 256, (16, 64, 4, 1, False)): 81928,
    ('100', 'dq', 'fp16', 256, (64, 16, 4, 1, False)): 81928,
    ('100', 'dkdv', 'fp32', 64, (32, 32, 4, 1, False)): 36864,
    ('100', 'dq', 'fp32', 64, (32, 32, 4, 1, False)): 32768,
    ('100', 'dkdv', 'fp32', 128, (16, 32, 4, 1, False)): 51200,
    ('100', 'dq', 'fp32', 128, (32, 16, 4, 1, False)): 49152,
    ('100', 'dkdv', 'fp32', 256, (16, 32, 4, 1, False)): 100352,
    ('100', 'dq', 'fp32', 256, (32, 16, 4, 1, False)): 98304,
    ('100', 'decode', 'fp16', 128, (16, 64, 4, 2, False)): 38912,
    ('100', 'decode', 'fp16', 128, (16, 128, 4, 3, False)): 139264,
    ('100', 'decode-paged', 'fp16', 128, (16, 64, 4, 3, False)): 39424,
    ('100', 'decode-paged', 'fp16', 128, (16, 128, 4, 5, False)): 140288,
    ('100', 'decode', 'fp32', 128, (16, 32, 4, 2, False)): 49152,
    ('100', 'decode', 'fp16', 64, (16, 128, 4, 2, False)): 38912,
    ('100', 'decode', 'fp16', 64, (16, 256, 4, 3, False)): 141312,
    ('100', 'decode', 'fp16', 256, (16, 32, 4, 2, False)): 41984,
    ('120', 'fwd', 'fp16', 64, (128, 64, 4, 3, True)): 32800,
    ('120', 'fwd', 'fp16', 64, (64, 64, 4, 3, True)): 32800,
    ('120', 'fwd', 'fp16', 128, (128, 64, 8, 3, False)): 98304,
    ('120', 'fwd', 'fp16', 128, (64, 64, 4, 3, False)): 90112,
    ('120', 'fwd', 'fp16', 256, (64, 32, 4, 2, False)): 69632,
    ('120', 'fwd', 'fp32', 64, (64, 32, 4, 2, True)): 32792,
    ('120', 'fwd', 'fp32', 128, (32, 32, 4, 1, True)): 20496,
    ('120', 'fwd', 'fp32', 256, (32, 32, 4, 1, False)): 69632,
    ('120', 'dkdv', 'fp16', 64, (32, 128, 4, 3, False)): 49664,
    ('120', 'dq', 'fp16', 64, (64, 64, 4, 3, True)): 49184,
    ('120', 'dkdv', 'fp16', 128, (32, 64, 4, 3, False)): 70144,
    ('120', 'dq', 'fp16', 128, (64, 32, 4, 2, True)): 53272,
    ('120', 'dkdv', 'fp16', 256, (16, 64, 4, 1, False)): 90112,
    ('120', 'dq', 'fp16', 256, (64, 16, 4, 1, False)): 81920,
    ('120', 'dkdv', 'fp32', 64, (32, 32, 4, 1, False)): 36864,
    ('120', 'dq', 'fp32', 64, (32, 32, 4, 1, False)): 32768,
    ('120', 'dkdv', 'fp32', 128, (16, 32, 4, 1, False)): 51200,
    ('120', 'dq', 'fp32', 128, (32, 16, 4, 1, False)): 49152,
    ('120', 'dkdv', 'fp32', 256, (16, 32, 4, 1, False)): 100352,
    ('120', 'dq', 'fp32', 256, (32, 16, 4, 1, False)): 98304,
    ('120', 'decode', 'fp16', 128, (16, 64, 4, 2, False)): 38912,
    ('120', 'decode', 'fp16', 128, (16, 128, 4, 2, False)): 73728,
    ('120', 'decode-paged', 'fp16', 128, (16, 64, 4, 3, False)): 39424,
    ('120', 'decode-paged', 'fp16', 128, (16, 128, 4, 4, False)): 74240,
    ('120', 'decode', 'fp32', 128, (16, 32, 4, 2, False)): 49152,
    ('120', 'decode', 'fp16', 64, (16, 128, 4, 2, False)): 38912,
    ('120', 'decode', 'fp16', 64, (16, 256, 4, 2, False)): 75776,
    ('120', 'decode', 'fp16', 256, (16, 32, 4, 2, False)): 41984,
    ('gfx942', 'fwd', 'fp16', 64, (64, 64, 4, 3, False)): 40960,
    ('gfx942', 'fwd', 'fp16', 128, (64, 64, 4, 2, False)): 40960,
    ('gfx942', 'fwd', 'fp16', 256, (64, 16, 4, 2, False)): 32768,
    ('gfx942', 'fwd', 'fp32', 64, (64, 32, 4, 2, False)): 24576,
    ('gfx942', 'fwd', 'fp32', 128, (32, 32, 4, 1, False)): 16384,
    ('gfx942', 'fwd', 'fp32', 256, (32, 16, 4, 1, False)): 32768,
    ('gfx942', 'dkdv', 'fp16', 64, (32, 128, 4, 2, False)): 16384,
    ('gfx942', 'dq', 'fp16', 64, (64, 32, 4, 2, False)): 12288,
    ('gfx942', 'dkdv', 'fp16', 128, (32, 64, 4, 1, False)): 16384,
    ('gfx942', 'dq', 'fp16', 128, (64, 32, 4, 1, False)): 16384,
    ('gfx942', 'dkdv', 'fp16', 256, (16, 32, 4, 1, False)): 16384,
    ('gfx942', 'dq', 'fp16', 256, (32, 16, 4, 1, False)): 16384,
    ('gfx942', 'decode', 'fp16', 128, (16, 64, 4, 2, False)): 32768,
    ('gfx942', 'decode-paged', 'fp16', 128, (16, 32, 4, 3, False)): 16640,
    ('gfx942', 'decode-paged', 'fp16', 128, (16, 32, 4, 4, False)): 33024,
    ('gfx942', 'decode', 'fp16', 64, (16, 128, 4, 2, False)): 32768,
    ('gfx942', 'decode', 'fp16', 256, (16, 32, 4, 2, False)): 32768,
    ('gfx90a', 'fwd', 'fp32', 64, (64, 32, 4, 2, False)): 24576,
    ('gfx90a', 'fwd', 'fp32', 128, (32, 32, 4, 1, False)): 16384,
    ('gfx90a', 'fwd', 'fp32', 256, (32, 16, 4, 1, False)): 32768,
}


@pytest.mark.parametrize("key", list(COMPILED_SHARED), ids=lambda k: f"{k[0]}-{k[1]}-{k[2]}-D{k[3]}-{k[4]}")
def test_estimates_cover_compiled_kernels(key):
    target, kernel, dtype, block_d, (bm, bn, warps, stages, tma) = key
    elt = DTYPES[dtype].itemsize
    tcgen05 = target == "100"
    if kernel == "fwd":
        est = configs.forward_shared_bytes(FwdConfig(bm, bn, warps, stages, "host" if tma else "none"),
                                           block_d=block_d, elt=elt, tcgen05=tcgen05)
    elif kernel in ("dkdv", "dq"):
        est = configs.backward_shared_bytes(BwdConfig(bm, bn, warps, stages, tma), block_d=block_d, elt=elt,
                                            kept="block_n" if kernel == "dkdv" else "block_m", tcgen05=tcgen05)
    else:
        # fit_decode counts AMD's paged stages as the contiguous loop's.
        paged = kernel == "decode-paged" and not target.startswith("gfx")
        est = configs.decode_shared_bytes(configs._DecodeTile(bn, warps, stages, 1), block_m=bm, paged=paged,
                                          block_d=block_d, elt=elt)
    assert est >= COMPILED_SHARED[key]


# --------------------------------------------------------------------------------------------------
# H100 / H200: the measured tables, unchanged
# --------------------------------------------------------------------------------------------------

SM90_FORWARD = {
    ("fp16", 64, False, 8, 512): (64, 64, 4, 3, "host"),
    ("fp16", 64, False, 64, 1024): (128, 64, 4, 3, "host"),
    ("fp16", 64, False, 32, 4096): (128, 64, 4, 3, "host"),
    ("fp16", 64, True, 8, 512): (64, 64, 4, 3, "host"),
    ("fp16", 64, True, 64, 1024): (64, 64, 4, 3, "host"),
    ("fp16", 64, True, 32, 4096): (64, 64, 4, 3, "host"),
    ("fp16", 128, False, 8, 512): (64, 64, 4, 3, "host"),
    ("fp16", 128, False, 64, 1024): (128, 128, 8, 3, "host"),
    ("fp16", 128, False, 32, 4096): (128, 128, 8, 3, "host"),
    ("fp16", 128, True, 8, 512): (64, 64, 4, 3, "host"),
    ("fp16", 128, True, 64, 1024): (64, 64, 4, 3, "host"),
    ("fp16", 128, True, 32, 4096): (128, 128, 8, 3, "host"),
    ("fp16", 256, False, 8, 512): (64, 64, 4, 2, "host"),
    ("fp16", 256, False, 64, 1024): (64, 64, 4, 2, "host"),
    ("fp16", 256, False, 32, 4096): (64, 64, 4, 2, "host"),
    ("fp16", 256, True, 8, 512): (64, 64, 4, 2, "host"),
    ("fp16", 256, True, 64, 1024): (64, 64, 4, 2, "host"),
    ("fp16", 256, True, 32, 4096): (64, 64, 4, 2, "host"),
    ("bf16", 64, False, 8, 512): (64, 64, 4, 3, "host"),
    ("bf16", 64, False, 64, 1024): (128, 64, 4, 3, "host"),
    ("bf16", 64, False, 32, 4096): (128, 64, 4, 3, "host"),
    ("bf16", 64, True, 8, 512): (64, 64, 4, 3, "host"),
    ("bf16", 64, True, 64, 1024): (64, 64, 4, 3, "host"),
    ("bf16", 64, True, 32, 4096): (64, 64, 4, 3, "host"),
    ("bf16", 128, False, 8, 512): (64, 64, 4, 3, "host"),
    ("bf16", 128, False, 64, 1024): (128, 128, 8, 3, "host"),
    ("bf16", 128, False, 32, 4096): (128, 128, 8, 3, "host"),
    ("bf16", 128, True, 8, 512): (64, 64, 4, 3, "host"),
    ("bf16", 128, True, 64, 1024): (64, 64, 4, 3, "host"),
    ("bf16", 128, True, 32, 4096): (128, 128, 8, 3, "host"),
    ("bf16", 256, False, 8, 512): (64, 64, 4, 2, "host"),
    ("bf16", 256, False, 64, 1024): (64, 64, 4, 2, "host"),
    ("bf16", 256, False, 32, 4096): (64, 64, 4, 2, "host"),
    ("bf16", 256, True, 8, 512): (64, 64, 4, 2, "host"),
    ("bf16", 256, True, 64, 1024): (64, 64, 4, 2, "host"),
    ("bf16", 256, True, 32, 4096): (64, 64, 4, 2, "host"),
    ("fp32", 64, False, 8, 512): (64, 32, 4, 2, "host"),
    ("fp32", 64, False, 64, 1024): (64, 32, 4, 2, "host"),
    ("fp32", 64, False, 32, 4096): (64, 32, 4, 2, "host"),
    ("fp32", 64, True, 8, 512): (64, 32, 4, 2, "host"),
    ("fp32", 64, True, 64, 1024): (64, 32, 4, 2, "host"),
    ("fp32", 64, True, 32, 4096): (64, 32, 4, 2, "host"),
    ("fp32", 128, False, 8, 512): (32, 32, 4, 1, "host"),
    ("fp32", 128, False, 64, 1024): (32, 32, 4, 1, "host"),
    ("fp32", 128, False, 32, 4096): (32, 32, 4, 1, "host"),
    ("fp32", 128, True, 8, 512): (32, 32, 4, 1, "host"),
    ("fp32", 128, True, 64, 1024): (32, 32, 4, 1, "host"),
    ("fp32", 128, True, 32, 4096): (32, 32, 4, 1, "host"),
    ("fp32", 256, False, 8, 512): (32, 32, 4, 1, "host"),
    ("fp32", 256, False, 64, 1024): (32, 32, 4, 1, "host"),
    ("fp32", 256, False, 32, 4096): (32, 32, 4, 1, "host"),
    ("fp32", 256, True, 8, 512): (32, 32, 4, 1, "host"),
    ("fp32", 256, True, 64, 1024): (32, 32, 4, 1, "host"),
    ("fp32", 256, True, 32, 4096): (32, 32, 4, 1, "host"),
}
SM90_BACKWARD = {
    ("fp16", 64): ((32, 128, 4, 3, False), (64, 64, 4, 3, True)),
    ("fp16", 128): ((32, 64, 4, 3, False), (64, 64, 4, 2, True)),
    ("fp16", 256): ((16, 64, 4, 1, False), (64, 16, 4, 1, False)),
    ("bf16", 64): ((32, 128, 4, 3, False), (64, 64, 4, 3, True)),
    ("bf16", 128): ((32, 64, 4, 3, False), (64, 64, 4, 2, True)),
    ("bf16", 256): ((16, 64, 4, 1, False), (64, 16, 4, 1, False)),
    ("fp32", 64): ((32, 32, 4, 1, False), (32, 32, 4, 1, False)),
    ("fp32", 128): ((16, 32, 4, 1, False), (32, 16, 4, 1, False)),
    ("fp32", 256): ((16, 32, 4, 1, False), (32, 16, 4, 1, False)),
}
# (dtype, head_dim, rows, batch, paged, page_size, max_seqlen, gluon)
#     -> (block_m, block_n, warps, stages, splits, kernel)
SM90_DECODE = {
    ("fp16", 64, 4, 1, False, None, 8192, False): (16, 128, 4, 2, 32, "triton"),
    ("fp16", 64, 4, 1, True, 16, 8192, False): (16, 128, 4, 3, 32, "triton"),
    ("fp16", 64, 4, 1, True, 5, 8192, False): (16, 128, 4, 3, 32, "triton"),
    ("fp16", 64, 4, 16, False, None, 8192, False): (16, 256, 4, 3, 1, "triton"),
    ("fp16", 64, 4, 16, True, 16, 8192, False): (16, 256, 4, 5, 1, "triton"),
    ("fp16", 64, 4, 16, True, 5, 8192, False): (16, 256, 4, 5, 1, "triton"),
    ("fp16", 64, 4, 64, False, None, 8192, False): (16, 256, 4, 2, 1, "triton"),
    ("fp16", 64, 4, 64, True, 16, 8192, False): (16, 256, 4, 4, 1, "triton"),
    ("fp16", 64, 4, 64, True, 5, 8192, False): (16, 128, 4, 2, 1, "triton"),
    ("fp16", 128, 4, 1, False, None, 8192, False): (16, 64, 4, 2, 64, "triton"),
    ("fp16", 128, 4, 1, False, None, 8192, True): (64, 128, 4, 2, 16, "gluon"),
    ("fp16", 128, 4, 1, True, 16, 8192, False): (16, 64, 4, 3, 64, "triton"),
    ("fp16", 128, 4, 1, True, 16, 8192, True): (64, 128, 4, 2, 16, "gluon"),
    ("fp16", 128, 4, 1, True, 5, 8192, False): (16, 64, 4, 3, 64, "triton"),
    ("fp16", 128, 4, 1, True, 5, 8192, True): (64, 128, 4, 2, 16, "gluon"),
    ("fp16", 128, 4, 16, False, None, 8192, False): (16, 128, 4, 3, 1, "triton"),
    ("fp16", 128, 4, 16, False, None, 8192, True): (16, 128, 4, 3, 1, "triton"),
    ("fp16", 128, 4, 16, True, 16, 8192, False): (16, 128, 4, 5, 1, "triton"),
    ("fp16", 128, 4, 16, True, 16, 8192, True): (16, 128, 4, 5, 1, "triton"),
    ("fp16", 128, 4, 16, True, 5, 8192, False): (16, 128, 4, 5, 1, "triton"),
    ("fp16", 128, 4, 16, True, 5, 8192, True): (16, 128, 4, 5, 1, "triton"),
    ("fp16", 128, 4, 64, False, None, 8192, False): (16, 128, 4, 2, 1, "triton"),
    ("fp16", 128, 4, 64, False, None, 8192, True): (16, 128, 4, 2, 1, "triton"),
    ("fp16", 128, 4, 64, True, 16, 8192, False): (16, 128, 4, 4, 1, "triton"),
    ("fp16", 128, 4, 64, True, 16, 8192, True): (16, 128, 4, 4, 1, "triton"),
    ("fp16", 128, 4, 64, True, 5, 8192, False): (16, 64, 4, 2, 1, "triton"),
    ("fp16", 128, 4, 64, True, 5, 8192, True): (16, 64, 4, 2, 1, "triton"),
    ("fp16", 256, 4, 1, False, None, 8192, False): (16, 32, 4, 2, 32, "triton"),
    ("fp16", 256, 4, 1, True, 16, 8192, False): (16, 32, 4, 2, 32, "triton"),
    ("fp16", 256, 4, 1, True, 5, 8192, False): (16, 32, 4, 2, 32, "triton"),
    ("fp16", 256, 4, 16, False, None, 8192, False): (16, 32, 4, 2, 2, "triton"),
    ("fp16", 256, 4, 16, True, 16, 8192, False): (16, 32, 4, 2, 2, "triton"),
    ("fp16", 256, 4, 16, True, 5, 8192, False): (16, 32, 4, 2, 2, "triton"),
    ("fp16", 256, 4, 64, False, None, 8192, False): (16, 32, 4, 2, 1, "triton"),
    ("fp16", 256, 4, 64, True, 16, 8192, False): (16, 32, 4, 2, 1, "triton"),
    ("fp16", 256, 4, 64, True, 5, 8192, False): (16, 32, 4, 2, 1, "triton"),
    ("fp32", 64, 4, 1, False, None, 8192, False): (16, 32, 4, 2, 32, "triton"),
    ("fp32", 64, 4, 1, True, 16, 8192, False): (16, 32, 4, 2, 32, "triton"),
    ("fp32", 64, 4, 1, True, 5, 8192, False): (16, 32, 4, 2, 32, "triton"),
    ("fp32", 64, 4, 16, False, None, 8192, False): (16, 32, 4, 2, 2, "triton"),
    ("fp32", 64, 4, 16, True, 16, 8192, False): (16, 32, 4, 2, 2, "triton"),
    ("fp32", 64, 4, 16, True, 5, 8192, False): (16, 32, 4, 2, 2, "triton"),
    ("fp32", 64, 4, 64, False, None, 8192, False): (16, 32, 4, 2, 1, "triton"),
    ("fp32", 64, 4, 64, True, 16, 8192, False): (16, 32, 4, 2, 1, "triton"),
    ("fp32", 64, 4, 64, True, 5, 8192, False): (16, 32, 4, 2, 1, "triton"),
    ("fp32", 128, 4, 1, False, None, 8192, False): (16, 32, 4, 2, 32, "triton"),
    ("fp32", 128, 4, 1, True, 16, 8192, False): (16, 32, 4, 2, 32, "triton"),
    ("fp32", 128, 4, 1, True, 5, 8192, False): (16, 32, 4, 2, 32, "triton"),
    ("fp32", 128, 4, 16, False, None, 8192, False): (16, 32, 4, 2, 2, "triton"),
    ("fp32", 128, 4, 16, True, 16, 8192, False): (16, 32, 4, 2, 2, "triton"),
    ("fp32", 128, 4, 16, True, 5, 8192, False): (16, 32, 4, 2, 2, "triton"),
    ("fp32", 128, 4, 64, False, None, 8192, False): (16, 32, 4, 2, 1, "triton"),
    ("fp32", 128, 4, 64, True, 16, 8192, False): (16, 32, 4, 2, 1, "triton"),
    ("fp32", 128, 4, 64, True, 5, 8192, False): (16, 32, 4, 2, 1, "triton"),
    ("fp32", 256, 4, 1, False, None, 8192, False): (16, 32, 4, 2, 32, "triton"),
    ("fp32", 256, 4, 1, True, 16, 8192, False): (16, 32, 4, 2, 32, "triton"),
    ("fp32", 256, 4, 1, True, 5, 8192, False): (16, 32, 4, 2, 32, "triton"),
    ("fp32", 256, 4, 16, False, None, 8192, False): (16, 32, 4, 2, 2, "triton"),
    ("fp32", 256, 4, 16, True, 16, 8192, False): (16, 32, 4, 2, 2, "triton"),
    ("fp32", 256, 4, 16, True, 5, 8192, False): (16, 32, 4, 2, 2, "triton"),
    ("fp32", 256, 4, 64, False, None, 8192, False): (16, 32, 4, 2, 1, "triton"),
    ("fp32", 256, 4, 64, True, 16, 8192, False): (16, 32, 4, 2, 1, "triton"),
    ("fp32", 256, 4, 64, True, 5, 8192, False): (16, 32, 4, 2, 1, "triton"),
}
SM90_MERGE = {
    (64, 2, 4): (1, 2, 4),
    (64, 2, 32768): (32, 2, 4),
    (64, 150, 4): (1, 64, 4),
    (64, 150, 32768): (1, 64, 4),
    (256, 2, 4): (1, 2, 4),
    (256, 2, 32768): (8, 2, 4),
    (256, 150, 4): (1, 16, 4),
    (256, 150, 32768): (1, 16, 4),
}


@pytest.mark.parametrize("facts", [GPUS["H100 (sm_90)"], configs.H200], ids=["H100", "H200"])
def test_sm90_choices_unchanged(facts):
    """The choices on an sm_90 GPU with 132 SMs and 232448 B per block, as they were before the
    choosers fitted other GPUs (the H200 measurements behind them: docs/performance-notes.md)."""
    for (dtype, d, causal, bh, sq), want in SM90_FORWARD.items():
        cfg = fwd(facts, d, DTYPES[dtype], causal, bh, sq)
        assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.tma) == want, (dtype, d, causal, bh, sq)
    for (dtype, d), want in SM90_BACKWARD.items():
        got = configs.backward_config(head_dim=d, dtype=DTYPES[dtype], device=facts)
        assert tuple((c.block_m, c.block_n, c.num_warps, c.num_stages, c.tma) for c in got) == want, (dtype, d)
    for (dtype, d, rows, batch, paged, page, max_seqlen, gluon), want in SM90_DECODE.items():
        cfg = dec(facts, d, DTYPES[dtype], batch, paged, page, rows, max_seqlen, (lambda: True) if gluon else None)
        got = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.num_splits, cfg.kernel)
        assert got == want, (dtype, d, rows, batch, paged, page, max_seqlen, gluon)
    for (block_d, parts, rows), want in SM90_MERGE.items():
        assert configs.merge_config(block_d=block_d, num_parts=parts, num_rows=rows, device=facts) == want


# --------------------------------------------------------------------------------------------------
# AMD: never the NVIDIA-only paths
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", HIP)
def test_hip_never_takes_gluon_or_tma(name):
    facts = GPUS[name]
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            assert not configs.gluon_hopper_applies(head_dim=d, dtype=dtype, device=facts)
            kw = dict(head_dim=d, dtype=dtype, device=facts, causal=True, seqlen_q=4096, seqlen_k=4096)
            assert dispatch.forward_variant(**kw) == dispatch.TRITON
            assert dispatch.backward_variant(**kw) == dispatch.TRITON
            assert fwd(facts, d, dtype).tma == "none"
            assert not any(c.tma for c in configs.backward_config(head_dim=d, dtype=dtype, device=facts))
            # Shapes where an sm_90 GPU takes the Gluon decode kernel: the Triton one here, and the
            # inputs' check (decode_hopper.supported) is not even asked.
            asked = []
            cfg = dec(facts, 128, dtype, batch=1, max_seqlen=65536, gluon=lambda: asked.append(1) or True)
            assert cfg.kernel == "triton" and not asked
    h200 = dec(configs.H200, 128, torch.float16, batch=1, max_seqlen=65536, gluon=lambda: True)
    assert h200.kernel == "gluon"        # the same call on an H200 takes it


def test_rocm_properties_read_as_hip(monkeypatch):
    """On ROCm, torch.cuda reports an MI250X as capability 9.0, Hopper's: torch.version.hip tells
    them apart. The facts come from torch.cuda.get_device_properties, including the shared memory
    per block where torch reports it."""
    props = types.SimpleNamespace(major=9, minor=0, multi_processor_count=110, shared_memory_per_block_optin=65536,
                                  name="AMD Instinct MI250X", gcnArchName="gfx90a:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    configs.clear_device_cache()
    facts = configs.device_facts("cuda")
    assert facts == DeviceFacts(9, 0, 110, 65536, is_hip=True, name="gfx90a:sramecc+:xnack-")
    assert not facts.hopper and not facts.tma
    assert not configs.gluon_hopper_applies(head_dim=128, dtype=torch.float16, device="cuda")
    assert dispatch.forward_variant(head_dim=128, dtype=torch.float16, device="cuda", causal=False,
                                    seqlen_q=4096, seqlen_k=4096) == dispatch.TRITON
    assert fwd("cuda", 128, torch.float16) == fwd(GPUS["MI250X (gfx90a)"], 128, torch.float16)


def test_nvidia_properties_and_capability_fallback(monkeypatch):
    """An sm_90 GPU read through torch.cuda is the H200 of the tables; a torch without
    shared_memory_per_block_optin gets the capability's figure."""
    props = types.SimpleNamespace(major=9, minor=0, multi_processor_count=132, shared_memory_per_block_optin=232448,
                                  name="NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    configs.clear_device_cache()
    assert configs.device_facts("cuda") == configs.H200
    assert configs.gluon_hopper_applies(head_dim=128, dtype=torch.float16, device="cuda") == configs.gluon_available()
    older = types.SimpleNamespace(major=8, minor=6, multi_processor_count=84, name="NVIDIA A10")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: older)
    configs.clear_device_cache()
    assert configs.device_facts("cuda").shared_per_block == 101376


# --------------------------------------------------------------------------------------------------
# The choice follows the device's properties
# --------------------------------------------------------------------------------------------------

def test_choice_follows_shared_memory_not_major():
    """Same major, different shared memory: different tiles (A100 keeps the H200's D=128 tile, an
    sm_86 GPU cannot hold it); an sm_90 part with less shared memory would be fitted too; the same
    shared memory gives the same tiles whatever the capability."""
    a100, a10 = GPUS["A100 (sm_80)"], GPUS["RTX 3090 / A10 (sm_86)"]
    assert fwd(a100, 128, torch.float16) == FwdConfig(128, 128, 8, 3, "none")
    assert fwd(a10, 128, torch.float16) != fwd(a100, 128, torch.float16)
    small_hopper = DeviceFacts(9, 0, 132, 101376)
    assert fwd(small_hopper, 128, torch.float16) != fwd(configs.H200, 128, torch.float16)
    assert configs.forward_shared_bytes(fwd(small_hopper, 128, torch.float16), block_d=128, elt=2) <= 101376
    assert fwd(GPUS["RTX 5090 (sm_120)"], 256, torch.bfloat16) == fwd(a10, 256, torch.bfloat16)
    # Multiprocessors: the short-problem rule and the decode split count follow the SM count.
    assert fwd(DeviceFacts(9, 0, 16, 232448), 64, torch.float16, bh=8, sq=1024).block_m == 128
    assert fwd(configs.H200, 64, torch.float16, bh=8, sq=1024).block_m == 64
    assert dec(GPUS["B200 (sm_100)"], 128, torch.float16, 1).num_splits != dec(GPUS["L4 (sm_89, 58 SMs)"], 128,
                                                                                torch.float16, 1).num_splits


def test_clear_error_where_nothing_fits():
    """fp32 at head dim 256 has no backward tile within 64 KB (AMD CDNA): a ValueError that names the
    limit and the way out, not Triton's OutOfResources at launch."""
    with pytest.raises(ValueError, match="65536 bytes of shared memory.*scaled_dot_product_attention"):
        configs.backward_config(head_dim=256, dtype=torch.float32, device=GPUS["MI300X (gfx942)"])
    tiny = DeviceFacts(8, 6, 10, 16384)
    with pytest.raises(ValueError, match="no forward tile at head dim 256"):
        fwd(tiny, 256, torch.float32)


def test_amd_gets_a_clear_error_where_kernels_do_not_compile():
    """dispatch.amd_unsupported: on ROCm, MI300 (9.4) fp16/bf16 forward and backward run; fp32, decode,
    merging and MI200 (9.0) are refused with a reason (they fail to compile there), NVIDIA never is."""
    import torch

    from triflash.kernels import configs, dispatch

    mi300 = configs.DeviceFacts(9, 4, 304, 65536, is_hip=True, name="AMD Instinct MI300X")
    mi250 = configs.DeviceFacts(9, 0, 104, 65536, is_hip=True, name="AMD Instinct MI250X")
    h100 = configs.DeviceFacts(9, 0, 132, 232448)
    for what in ("forward", "backward"):
        for dtype in (torch.float16, torch.bfloat16):
            assert dispatch.amd_unsupported(mi300, dtype, what) is None
            assert "MI250X" in dispatch.amd_unsupported(mi250, dtype, what)
        assert "float32" in dispatch.amd_unsupported(mi300, torch.float32, what)
    for what in ("decode", "merge"):
        assert what in dispatch.amd_unsupported(mi300, torch.float16, what)
    assert all(dispatch.amd_unsupported(h100, dtype, what) is None for dtype in (torch.float16, torch.float32)
               for what in ("forward", "backward", "decode", "merge"))
