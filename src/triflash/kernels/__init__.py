"""Triton kernels and their launchers. Each module holds @triton.jit kernels plus one launcher."""
