"""Build the model for a checkpoint folder and stream its safetensors into it.

Shards are read one tensor at a time (peak host memory ≈ the largest tensor plus fp8
weights waiting for their scale), with one progress line per shard. FP8 block-quantized
checkpoints are dequantized on load unless the layer keeps fp8 (`fp8_block` on CUDA).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from inference_svc.layers.quant import make_quant_method
from inference_svc.model.config import ModelConfig, load_config
from inference_svc.model.tokenizer import Tokenizer, load_tokenizer
from inference_svc.model.weight_map import Target, map_name
from inference_svc.models.deepseek_v3 import DeepseekV3Model
from kernels.fp8 import FP8_DTYPE, block_dequant_ref

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]  # (shard index, shard count, shard name)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: DeepseekV3Model
    tokenizer: Tokenizer


def shard_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: from the index if sharded, else the single file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    return files


def iter_checkpoint(
    folder: Path, progress: Progress | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) shard by shard."""
    files = shard_files(folder)
    for i, path in enumerate(files):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                yield name, f.get_tensor(name)
        log.info("loaded shard %d/%d %s", i + 1, len(files), path.name)
        if progress is not None:
            progress(i + 1, len(files), path.name)


def choose_quant(config: ModelConfig, device: torch.device) -> str:
    """fp8 checkpoints stay fp8 on CUDA (block-scaled kernel); everything else is dequantized."""
    return "fp8_block" if config.quant is not None and device.type == "cuda" else "bf16"


class WeightLoader:
    """Routes checkpoint tensors to parameters and checks every parameter got filled."""

    def __init__(self, model: DeepseekV3Model):
        self.model = model
        self.config = model.config
        self._pending: dict[tuple[str, str, int, int | None], dict[str, torch.Tensor]] = {}
        self._filled: dict[int, int] = {}
        self._params = {id(p): (n, p) for n, p in model.named_parameters(remove_duplicate=True)}

    def _count(self, param: torch.Tensor, tensor: torch.Tensor) -> None:
        self._filled[id(param)] = self._filled.get(id(param), 0) + tensor.numel()

    def _keeps_fp8(self, target: Target) -> bool:
        module = self.model.get_submodule(target.module)
        holder = getattr(module, target.which) if target.kind == "experts" else module
        return hasattr(holder, "weight_scale_inv")

    def add(self, name: str, tensor: torch.Tensor) -> None:
        target = map_name(name, self.config)
        if target is None:
            return
        if target.kind == "param":
            param = getattr(self.model.get_submodule(target.module), target.attr)
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            param.data.copy_(tensor)
            self._count(param, tensor)
            return
        is_fp8_part = target.tensor_kind == "scale" or tensor.dtype == FP8_DTYPE
        if is_fp8_part and not self._keeps_fp8(target):
            self._dequant_when_complete(name, target, tensor)
            return
        self._load(target, target.tensor_kind, tensor)

    def _dequant_when_complete(self, name: str, target: Target, tensor: torch.Tensor) -> None:
        """Hold an fp8 weight or its scale until the other half arrives, then dequantize."""
        key = (target.module, target.which, target.slice_index, target.expert)
        parts = self._pending.setdefault(key, {})
        parts[target.tensor_kind] = tensor
        parts.setdefault("name", name)
        if "weight" in parts and "scale" in parts:
            del self._pending[key]
            q = self.config.quant
            block = (q.block_n, q.block_k) if q else (128, 128)
            self._load(target, "weight", block_dequant_ref(parts["weight"], parts["scale"], block))

    def _load(self, target: Target, kind: str, tensor: torch.Tensor) -> None:
        module = self.model.get_submodule(target.module)
        if target.kind == "linear":
            module.load(kind, tensor, target.slice_index)
            holder = module
        else:
            module.load(target.which, kind, tensor, target.expert, target.slice_index)
            holder = getattr(module, target.which)
        self._count(holder.weight if kind == "weight" else holder.weight_scale_inv, tensor)

    def finish(self) -> None:
        """Raise if an fp8 half is orphaned or any parameter was not (fully) loaded."""
        if self._pending:
            names = sorted(parts["name"] for parts in self._pending.values())
            raise ValueError(f"fp8 tensors without their weight/weight_scale_inv pair: {names[:5]}")
        missing = [
            name
            for pid, (name, param) in self._params.items()
            if self._filled.get(pid, 0) != param.numel()
        ]
        if missing:
            raise ValueError(
                f"checkpoint lacks weights for {len(missing)} parameters: {missing[:5]}"
            )


# How the routed experts' GEMMs take their activations (RuntimeConfig.expert_activations):
# "bf16" as they are (the exact GEMM on the dequantized weights), "e4m3" rounded per row
# and 128-group to e4m3 like DeepSeek-V3's own FP8 inference (e4m3 × e4m3 MMAs: MoE prefill
# ~30 % faster on the H100, outputs a rounding apart; FP8 checkpoints kept in fp8 only).
EXPERT_ACTIVATIONS = ("bf16", "e4m3")


def check_expert_activations(expert_activations: str) -> None:
    if expert_activations not in EXPERT_ACTIVATIONS:
        raise ValueError(
            f"expert activations must be one of {EXPERT_ACTIVATIONS}, got {expert_activations!r}"
        )


def expert_quant_name(quant_name: str, expert_activations: str) -> str | None:
    """The routed experts' quant method when it differs from the model's (None: the same)."""
    check_expert_activations(expert_activations)
    if expert_activations == "bf16":
        return None
    if quant_name != "fp8_block":
        raise ValueError(
            f"e4m3 expert activations need an FP8 checkpoint kept in fp8 (on CUDA); this "
            f"model's weights load as {quant_name}"
        )
    return "fp8_block_a8"


def build_model(
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    quant_method: str | None = None,
    expert_activations: str = "bf16",
) -> DeepseekV3Model:
    """An empty model for `config`; the quant method defaults to the device's choice,
    the routed experts' follows `expert_activations` (EXPERT_ACTIVATIONS)."""
    device = torch.device(device)
    q = config.quant
    block = (q.block_n, q.block_k) if q else None
    name = quant_method or choose_quant(config, device)
    expert_name = expert_quant_name(name, expert_activations)
    quant = make_quant_method(name, block)
    expert_quant = make_quant_method(expert_name, block) if expert_name else None
    return DeepseekV3Model(config, quant, dtype, device, expert_quant).eval()


def load_weights(model: DeepseekV3Model, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill `model` from (checkpoint name, tensor) pairs and check completeness."""
    loader = WeightLoader(model)
    with torch.no_grad():
        for name, tensor in tensors:
            loader.add(name, tensor)
    loader.finish()


def load_model(
    folder: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
    expert_activations: str = "bf16",
) -> LoadedModel:
    """Config, weights and tokenizer of an HF DeepSeek-V2/V3 folder."""
    folder = Path(folder)
    config = load_config(folder)
    model = build_model(config, device, dtype, expert_activations=expert_activations)
    load_weights(model, iter_checkpoint(folder, progress))
    return LoadedModel(config, model, load_tokenizer(folder, config))
