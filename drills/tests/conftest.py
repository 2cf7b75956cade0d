"""Drill tests: ``python -m pytest drills/tests`` checks your kernels in drills/mine/;
``python -m pytest drills/tests --target solutions`` checks the reference solutions.

Without a CUDA GPU every kernel runs in Triton's CPU interpreter, which must be switched on before
triton is imported: that happens here, first thing. With a GPU the same tests run on it.
"""

import importlib
import os
import sys
from pathlib import Path

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DRILLS = Path(__file__).resolve().parents[1]
for path in (DRILLS, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

TARGETS = ("mine", "solutions")


def pytest_addoption(parser):
    parser.addoption("--target", choices=TARGETS, default="mine",
                     help="which drill files to test: mine (your kernels, the default) or solutions")


def pytest_report_header(config):
    import triton

    where = torch.cuda.get_device_name() if ON_GPU else "CPU, TRITON_INTERPRET=1"
    return (f"drills: target={config.getoption('--target')} (drills/{config.getoption('--target')}/); "
            f"{where}; torch {torch.__version__}, triton {triton.__version__}")


@pytest.fixture(scope="session")
def target(request) -> str:
    return request.config.getoption("--target")


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if ON_GPU else "cpu"


def load_drill(target: str, name: str):
    """drills/<target>/<name>.py as a module (``mine.t5_flash_attn`` or ``solutions.t5_flash_attn``)."""
    return importlib.import_module(f"{target}.{name}")
