"""Triton multi-LoRA and model kernels, each with a launcher and a plain-torch reference."""
