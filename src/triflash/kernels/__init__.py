"""Triton kernels and their launchers. Each module holds @triton.jit kernels plus one launcher."""
from . import configs

if configs.INTERPRET:
    from . import interpreter

    interpreter.install()
