"""The canonical adapter format: tensor names, manifest, reader and writer.

Written by the store (after PEFT normalization), read by the inference service. One
`weights.safetensors` plus one `manifest.json` per adapter version. Per decoder layer `L`
and canonical module `M` (see `CANONICAL_MODULES`) the weights hold
`layers.L.M.lora_A` `[stack*r, in]` and `layers.L.M.lora_B` `[sum(out_slices), r]`
(MoE modules: a leading expert dim, 1 for the shared side of "shared_outer" adapters).
Scaling is already folded into lora_B; rows/columns beyond a module's true rank are zero.

CPU-only dependencies (torch, safetensors, json, hashlib) so both services can import it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any, Literal

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from adapter_store.byte_pieces import BytePieces
from adapter_store.errors import InvalidArgument
from adapter_store.model_shapes import (
    CANONICAL_MODULES,
    ModuleShape,
    is_routed_expert_module,
    iter_layer_modules,
    model_lora_shapes,
    shape_at,
)
from adapter_store.safetensors_pieces import SafetensorsError, read_safetensors

__all__ = [
    "CANONICAL_MODULES",
    "DTYPES",
    "FORMAT_VERSION",
    "MOE_LAYOUTS",
    "DIGEST_PART_BYTES",
    "CanonicalAdapter",
    "Manifest",
    "ModuleShape",
    "deserialize",
    "deserialize_pieces",
    "iter_layer_modules",
    "model_lora_shapes",
    "module_key",
    "parse_tensor_name",
    "parts_digest",
    "serialize",
    "shape_at",
    "tensor_name",
]

FORMAT_VERSION = 1
# Bytes per digested part of weights.safetensors (Manifest.part_sha256): the size of one
# ranged GET, so a reader checks each part on the thread that fetched it.
DIGEST_PART_BYTES = 8 << 20
MIN_DIGEST_PART_BYTES = 4096  # bounds the GETs a manifest can ask for (tests use small parts)
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
MOE_LAYOUTS = ("none", "per_expert", "shared_outer")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
LoraPart = Literal["lora_A", "lora_B"]

_TENSOR_NAME = re.compile(r"^layers\.(\d+)\.([a-z_]+\.[a-z_]+)\.(lora_A|lora_B)$")


def module_key(layer: int, module: str) -> str:
    """Key of one module instance in the manifest: "layers.L.module"."""
    return f"layers.{layer}.{module}"


def tensor_name(layer: int, module: str, part: LoraPart) -> str:
    """Name of a canonical tensor: "layers.L.module.lora_A" / ".lora_B"."""
    return f"{module_key(layer, module)}.{part}"


def parse_tensor_name(name: str) -> tuple[int, str, LoraPart]:
    """Inverse of `tensor_name`; raises InvalidArgument for anything else."""
    match = _TENSOR_NAME.match(name)
    if not match or match.group(2) not in CANONICAL_MODULES:
        raise InvalidArgument(f"not a canonical tensor name: {name!r}")
    return int(match.group(1)), match.group(2), match.group(3)  # type: ignore[return-value]


@functools.lru_cache(maxsize=16384)
def _parse_module_key(key: str) -> tuple[int, str]:
    """(layer, module) of a manifest key. Cached: every slot load reads its adapter's
    ~200 keys, the same keys for every adapter of a model (H100 serving: 1.2 ms of regex
    per load)."""
    layer, module, _ = parse_tensor_name(f"{key}.lora_A")
    return layer, module


@dataclass
class Manifest:
    """What a reader needs besides the tensors, plus provenance (the source PEFT config)."""

    format_version: int
    base_model: str
    rank: int  # r: every module's lora_A/lora_B is padded to it
    module_ranks: dict[str, int]  # "layers.L.module" -> true rank before padding
    moe_layout: str  # "none" | "per_expert" | "shared_outer"
    dtype: str  # "float32" | "bfloat16" | "float16"
    sha256: str  # of the weights.safetensors bytes ("" until serialized)
    size_bytes: int
    source_peft_config: dict[str, Any]
    # "layers.L.module" -> output width of each stacked slice (splits lora_B's rows).
    module_slices: dict[str, list[int]] = field(default_factory=dict)
    # sha256 of each `part_bytes` of the weights (the last part shorter), so a reader
    # verifies parts on several cores as they arrive instead of one in-order digest of the
    # whole file. Empty in manifests written before parts were digested.
    part_bytes: int = 0
    part_sha256: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise InvalidArgument(
                f"manifest format_version {self.format_version!r} is not supported "
                f"(this build reads {FORMAT_VERSION})"
            )
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise InvalidArgument(f"manifest rank must be a positive integer, got {self.rank!r}")
        if self.moe_layout not in MOE_LAYOUTS:
            raise InvalidArgument(f"manifest moe_layout {self.moe_layout!r} not in {MOE_LAYOUTS}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"manifest dtype {self.dtype!r} not in {tuple(DTYPES)}")
        for key, rank in self.module_ranks.items():
            parse_tensor_name(f"{key}.lora_A")
            if not isinstance(rank, int) or not 0 < rank <= self.rank:
                raise InvalidArgument(
                    f"manifest module_ranks[{key!r}] = {rank!r} not in 1..{self.rank}"
                )
        if set(self.module_slices) != set(self.module_ranks):
            raise InvalidArgument("manifest module_slices and module_ranks name different modules")
        if self.part_sha256:
            self._check_parts()

    def _check_parts(self) -> None:
        if not isinstance(self.part_bytes, int) or self.part_bytes < MIN_DIGEST_PART_BYTES:
            raise InvalidArgument(
                f"manifest part_bytes {self.part_bytes!r} is below {MIN_DIGEST_PART_BYTES}"
            )
        parts = -(-self.size_bytes // self.part_bytes)
        if len(self.part_sha256) != parts:
            raise InvalidArgument(
                f"manifest part_sha256 has {len(self.part_sha256)} digests, {self.size_bytes} "
                f"bytes in parts of {self.part_bytes} need {parts}"
            )
        for index, digest in enumerate(self.part_sha256):
            if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
                raise InvalidArgument(f"manifest part_sha256[{index}] is not 64 hex digits")

    @property
    def parts_sha256(self) -> str:
        """The digest that binds `part_sha256` to the store's record ("" without parts)."""
        return parts_digest(self.part_bytes, self.part_sha256)

    def part_range(self, index: int) -> tuple[int, int]:
        """[start, end) bytes of part `index` of the weights."""
        start = index * self.part_bytes
        return start, min(start + self.part_bytes, self.size_bytes)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidArgument(f"manifest.json is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise InvalidArgument("manifest.json must hold a JSON object")
        names = {f.name for f in fields(cls)}
        required = {
            f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
        }
        missing = sorted(n for n in required if n not in raw)
        if missing:
            raise InvalidArgument(f"manifest.json lacks fields {missing}")
        try:
            return cls(**{k: v for k, v in raw.items() if k in names})
        except (TypeError, AttributeError, ValueError) as exc:
            raise InvalidArgument(f"manifest.json is malformed: {exc}") from None

    @property
    def modules(self) -> list[tuple[int, str]]:
        """(layer, module) of every module instance the adapter has."""
        return [_parse_module_key(key) for key in self.module_ranks]

    @property
    def targets_routed_experts(self) -> bool:
        """Whether the adapter has LoRA on a routed-expert module (read from its modules, not
        from `moe_layout`, which a reader does not check against them)."""
        return any(is_routed_expert_module(module) for _, module in self.modules)


@dataclass
class CanonicalAdapter:
    manifest: Manifest
    tensors: dict[str, torch.Tensor]  # tensor_name(...) -> contiguous tensor

    def delta_weight(self, layer: int, module: str, expert: int | None = None) -> torch.Tensor:
        """Dense ΔW in float32: per slice s, B_s @ A_s, stacked on the output dim.

        Returns `[sum(out_slices), in]`; for moe.* with `expert=None`, `[E, sum(out_slices), in]`.
        """
        lora_A = self.tensors[tensor_name(layer, module, "lora_A")].float()
        lora_B = self.tensors[tensor_name(layer, module, "lora_B")].float()
        slices = self.manifest.module_slices[module_key(layer, module)]
        r = self.manifest.rank
        if is_routed_expert_module(module):
            if expert is None:
                experts = max(lora_A.shape[0], lora_B.shape[0])
                return torch.stack([self.delta_weight(layer, module, e) for e in range(experts)])
            # A leading dim of 1 is the shared side of a "shared_outer" adapter.
            lora_A = lora_A[expert if lora_A.shape[0] > 1 else 0]
            lora_B = lora_B[expert if lora_B.shape[0] > 1 else 0]
        b_rows = lora_B.split(slices, dim=0)  # per slice: [out_s, r]
        return torch.cat([b @ lora_A[s * r : (s + 1) * r] for s, b in enumerate(b_rows)])


def validate_tensors(manifest: Manifest, tensors: Mapping[str, torch.Tensor]) -> None:
    """Check that the tensors are exactly the manifest's modules with consistent shapes."""
    expected = {
        tensor_name(layer, module, part)
        for layer, module in manifest.modules
        for part in ("lora_A", "lora_B")
    }
    if set(tensors) != expected:
        extra, missing = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        raise InvalidArgument(
            f"weights do not match the manifest: extra {extra}, missing {missing}"
        )
    dtype = DTYPES[manifest.dtype]
    r = manifest.rank
    for layer, module in manifest.modules:
        key = module_key(layer, module)
        lora_A = tensors[tensor_name(layer, module, "lora_A")]
        lora_B = tensors[tensor_name(layer, module, "lora_B")]
        slices = manifest.module_slices[key]
        expert_dims = 1 if is_routed_expert_module(module) else 0
        for name, tensor in ((f"{key}.lora_A", lora_A), (f"{key}.lora_B", lora_B)):
            if tensor.dtype != dtype or tensor.dim() != 2 + expert_dims:
                raise InvalidArgument(
                    f"{name}: expected {2 + expert_dims}-D {manifest.dtype}, "
                    f"found {tensor.dim()}-D {str(tensor.dtype).removeprefix('torch.')}"
                )
        if lora_A.shape[-2] != len(slices) * r or tuple(lora_B.shape[-2:]) != (sum(slices), r):
            raise InvalidArgument(
                f"{key}: expected lora_A [.., {len(slices) * r}, in] and lora_B "
                f"[.., {sum(slices)}, {r}], found {list(lora_A.shape)} and {list(lora_B.shape)}"
            )


def parts_digest(part_bytes: int, part_sha256: list[str]) -> str:
    """sha256 of a manifest's part size and part digests, kept in the store's record so that
    the parts a reader verifies are the ones the store wrote ("" for no parts)."""
    if not part_sha256:
        return ""
    listing = json.dumps([part_bytes, part_sha256], separators=(",", ":"))
    return sha256_hex(listing.encode())


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def part_views(data: bytes | memoryview, part_bytes: int) -> list[memoryview]:
    """`data` cut into parts of `part_bytes` (the last one shorter), without copying."""
    view = memoryview(data)
    return [view[start : start + part_bytes] for start in range(0, len(view), part_bytes)]


def weights_digests(weights: bytes, part_bytes: int) -> tuple[str, list[str]]:
    """(sha256 of the whole, sha256 of each `part_bytes` part), hashed on several threads
    (hashlib releases the GIL)."""
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="digest") as pool:
        whole = pool.submit(sha256_hex, weights)
        return whole.result(), list(pool.map(sha256_hex, part_views(weights, part_bytes)))


def serialize(
    adapter: CanonicalAdapter, part_bytes: int = DIGEST_PART_BYTES
) -> tuple[bytes, bytes]:
    """-> (weights.safetensors bytes, manifest.json bytes); fills the manifest's digests
    (whole file and parts of `part_bytes`) and size."""
    validate_tensors(adapter.manifest, adapter.tensors)
    tensors = {name: tensor.contiguous() for name, tensor in adapter.tensors.items()}
    weights = save_safetensors(tensors, metadata={"format_version": str(FORMAT_VERSION)})
    whole, parts = weights_digests(weights, part_bytes)
    adapter.manifest = replace(
        adapter.manifest,
        sha256=whole,
        size_bytes=len(weights),
        part_bytes=part_bytes,
        part_sha256=parts,
    )
    return weights, adapter.manifest.to_json()


def deserialize(weights: bytes, manifest_json: bytes, *, verify: bool = True) -> CanonicalAdapter:
    """Read a canonical adapter; raises InvalidArgument naming what is wrong."""
    manifest = Manifest.from_json(manifest_json)
    if verify:
        digest = sha256_hex(weights)
        if digest != manifest.sha256 or len(weights) != manifest.size_bytes:
            raise InvalidArgument(
                f"weights.safetensors does not match its manifest: sha256 {digest} "
                f"({len(weights)} bytes), manifest says {manifest.sha256} "
                f"({manifest.size_bytes} bytes)"
            )
    try:
        tensors = load_safetensors(weights)
    except Exception as exc:  # safetensors raises its own error types for malformed input
        raise InvalidArgument(f"weights.safetensors is malformed: {exc}") from None
    validate_tensors(manifest, tensors)
    return CanonicalAdapter(manifest=manifest, tensors=tensors)


def deserialize_pieces(
    weights: BytePieces, manifest: Manifest, views_of: torch.Tensor | None = None
) -> CanonicalAdapter:
    """`deserialize` of weights that arrived in pieces, read without joining them
    (adapter_store.safetensors_pieces); the caller has checked their digest against
    `manifest` (already parsed: callers check it before reading the weights). `views_of`:
    the same bytes as one uint8 tensor, which the tensors then view instead of copying."""
    try:
        tensors = read_safetensors(weights, views_of)
    except SafetensorsError as exc:
        raise InvalidArgument(f"weights.safetensors is malformed: {exc}") from None
    validate_tensors(manifest, tensors)
    return CanonicalAdapter(manifest=manifest, tensors=tensors)
