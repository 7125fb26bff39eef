"""PEFT LoRA adapter -> canonical adapter for a registered DeepSeek-V3-family base model.

Pure: bytes in, tensors out, no I/O. Every format quirk of PEFT is handled here, once:
    upload.py    files -> config + tensors (pickle refused, safetensors/NaN checked)
    settings.py  adapter_config.json -> rank/alpha per module (rslora, *_pattern), refusals
    targets.py   PEFT key -> canonical (module, slices, expert) for this base model
    pieces.py    LoRA pairs -> shape-checked, scaled pieces (incl. PEFT's fused-expert layout)
    assemble.py  pieces -> stacked, rank-padded canonical tensors

PEFT behaviour established with peft 0.21.2 + transformers 5.17 (tests/normalize pin it):
- `target_modules` naming gate_proj/up_proj/down_proj become `target_parameters`
  ["gate_up_proj", "down_proj"] on the fused routed experts, with rank_pattern/alpha_pattern
  `.*\\.gate_up_proj` doubled; dense and shared-expert MLPs then get no LoRA at all.
- `target_parameters` pairs are saved on the experts module itself, nested wrappers adding
  `.base_layer` (gate_up_proj innermost): lora_A `[E*r, in]`, lora_B `[out, E*r]`, r per expert.
- `all-linear` also adapts the MoE router (`mlp.gate`), which we refuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapter_store.errors import InvalidArgument, ResourceExhausted
from adapter_store.finite import all_finite
from adapter_store.format import (
    DTYPES,
    FORMAT_VERSION,
    CanonicalAdapter,
    Manifest,
    model_lora_shapes,
    validate_tensors,
)
from adapter_store.model_shapes import text_config
from adapter_store.normalize.assemble import assemble, float32_bytes_bound
from adapter_store.normalize.pieces import build_pieces
from adapter_store.normalize.settings import LoraSettings
from adapter_store.normalize.upload import read_upload

__all__ = ["normalize_peft"]


def normalize_peft(
    files: Mapping[str, bytes],
    base_config: dict[str, Any],
    *,
    base_model: str,
    max_rank: int,
    dtype: str | None = None,
    max_canonical_bytes: int | None = None,
) -> CanonicalAdapter:
    """Normalize an uploaded PEFT LoRA folder (filename -> bytes) into the canonical layout.

    Scaling is folded into lora_B, every module is zero-padded to the adapter rank (the
    largest module rank). Raises InvalidArgument naming the key and expected vs found shape.
    """
    dtype = dtype or "float32"
    if dtype not in DTYPES:
        raise InvalidArgument(f"dtype {dtype!r} not in {tuple(DTYPES)}")
    config = text_config(base_config)
    shapes = model_lora_shapes(config)
    upload = read_upload(files, vocab_size=config.get("vocab_size"))
    settings = LoraSettings.from_config(upload.config)
    pieces = build_pieces(upload.tensors, settings, shapes, config["num_hidden_layers"])

    rank = max(piece.rank for piece in pieces)
    if rank > max_rank:
        widest = max(pieces, key=lambda piece: piece.rank)
        raise InvalidArgument(
            f"{widest.source}: rank {rank} is above the maximum rank {max_rank} of this deployment"
        )
    if max_canonical_bytes is not None:
        needed = float32_bytes_bound(pieces, shapes, rank)
        if needed > max_canonical_bytes:
            raise ResourceExhausted(
                f"the canonical adapter would take up to {needed} bytes (rank {rank}, zero "
                f"padding included), above this deployment's limit of {max_canonical_bytes}"
            )
    canonical = assemble(pieces, shapes, rank)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        base_model=base_model,
        rank=rank,
        module_ranks=canonical.module_ranks,
        moe_layout=canonical.moe_layout,
        dtype=dtype,
        sha256="",
        size_bytes=0,
        source_peft_config=upload.config,
        module_slices=canonical.module_slices,
    )
    tensors = {name: t.to(DTYPES[dtype]).contiguous() for name, t in canonical.tensors.items()}
    for name, tensor in tensors.items():
        # Finite inputs can still overflow: a huge lora_alpha folded into lora_B, or values
        # past the range of the stored dtype (float16 ends at 65504).
        if not all_finite(tensor):
            raise InvalidArgument(
                f"{name}: not finite after folding the scaling into lora_B and converting to "
                f"{dtype} (lora_alpha or the weights are too large)"
            )
    validate_tensors(manifest, tensors)
    return CanonicalAdapter(manifest=manifest, tensors=tensors)
