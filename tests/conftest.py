"""Shared test setup: one suite for the CPU (Triton's interpreter) and a CUDA GPU.

Without a CUDA device the suite runs every kernel through Triton's interpreter, which must be switched
on before triton is imported: that is done here, first thing.
"""

import os
import zlib

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"

# The interpreter's tl.dot multiplies bfloat16's raw bits, so bf16 runs on the GPU only.
DTYPES = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else [torch.float16, torch.float32]


def pytest_report_header(config):
    import triton

    where = torch.cuda.get_device_name() if ON_GPU else "CPU, TRITON_INTERPRET=1"
    return f"triflash tests on {where}; torch {torch.__version__}, triton {triton.__version__}"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed_and_poison(request):
    """A different (but reproducible) seed per test, and NaN-filled torch.empty: any output element a
    kernel fails to write stays NaN, and every test checks for NaN."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(prev)
