"""Triton kernels, each beside its launcher and a plain-torch reference of the same function."""
