"""In-process serving setup shared by `bench.serve_offline` and `bench.serve_online`.

The engine is the real one (`inference_svc.runtime.assemble_engine`: scheduler, KV pages,
LoRA slot pool, host cache, residency, CUDA-graph decode) around a random-weight
DeepSeek-V2-Lite-shaped model with `q_lora_rank` 1536 (`bench.model_decode`'s builder). No
Redis, S3 or store: adapters are canonical files (`weights.safetensors` + `manifest.json`,
as the store writes them) in a local folder, read by `LocalFileSource`.

Host memory: a per-expert rank-16 adapter of this model is ~0.6 GB (rank 64: ~2.3 GB), so
1000 distinct ones do not fit the GPU machine's 128 GB. `AdapterLibrary` writes a few
distinct weight sets and maps any number of adapter names onto them; preloading a name puts
an entry into the host cache whose tensors alias its weight set's pinned tensors (no copy;
the cache's byte accounting counts every entry, so its capacity is set far above the real
memory use). Each name is still its own adapter to the engine: its own host entry, its own
GPU slot and its own host → GPU slot load.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from adapter_store.format import CANONICAL_MODULES, CanonicalAdapter, Manifest, serialize
from adapter_store.model_shapes import is_routed_expert_module
from adapter_store.synthetic import random_adapter
from bench.fp8_experts import EXPERT_WEIGHTS, fp8_block, quantize_routed_experts
from bench.lora_decode_overhead import v2_lite_config
from bench.model_decode import random_model
from inference_svc.adapters.owned_tensors import OwnedTensorsSource
from inference_svc.engine.engine import LLMEngine
from inference_svc.engine.kv_pages import pages_for
from inference_svc.engine.sequence import (
    AdapterBinding,
    GenerationParams,
    OutputSink,
    Sequence,
)
from inference_svc.lora import apply
from inference_svc.lora.packing import SlotPacking
from inference_svc.lora.pool import GIB
from inference_svc.metrics import InferenceMetrics
from inference_svc.model.config import parse_config
from inference_svc.model.tokenizer import ByteTokenizer
from inference_svc.models.deepseek_v3 import DeepseekV3Model
from inference_svc.runtime import DEFAULT_STEP_GRAPH_MAX_TOKENS, RuntimeConfig, assemble_engine

BASE_MODEL = "random-v2-lite-q1536"
TENANT = "bench"
FULL_LAYERS = 27  # DeepSeek-V2-Lite
ZIPF_EXPONENT = 1.1
# Device memory kept free for activations (8k-token prefill chunks), graphs and allocator
# slack when the LoRA pool is sized from what is left after weights and KV cache.
ACTIVATION_RESERVE_GB = 8.0
# Scale of random adapter weights: keeps the random model's activations finite (std 1
# LoRA weights on a 0.02-std model overflow bf16 and would route every token alike).
ADAPTER_STD = 0.02
# The host cache's logical capacity: entries alias a few pinned weight sets (see above).
HOST_CACHE_LOGICAL_GB = 1 << 20
# Its pinned arena, for the adapters fetched from files (the cold probes): 8 × 582 MB.
HOST_ARENA_GB = 5.0
# What the adapters target: every canonical module (issue 9's adapters), or every module
# but the routed experts (MLA, dense and shared-expert MLP: what most MoE fine-tunes train).
ADAPTER_MODULES = {
    "all": None,
    "no-routed": tuple(m for m in CANONICAL_MODULES if not is_routed_expert_module(m)),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The flags both serving benchmarks share (model, adapters, batch shape, output)."""
    parser.add_argument("--out", type=Path, required=True, help="JSON; the PNG goes beside it")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--layers", type=int, default=FULL_LAYERS, help="decoder layers (V2-Lite: 27)"
    )
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument(
        "--max-loras",
        type=int,
        default=ServeBenchConfig.max_loras,
        help="GPU slots (fewer when the device memory left holds fewer)",
    )
    parser.add_argument("--adapter-dir", type=Path, help="where adapter files go (default tmp)")
    parser.add_argument(
        "--experts",
        choices=EXPERT_WEIGHTS,
        default="bf16",
        help="routed experts' weights: bf16, or fp8 block-quantized (bench.fp8_experts)",
    )
    parser.add_argument(
        "--adapter-modules",
        choices=sorted(ADAPTER_MODULES),
        default="all",
        help="modules the adapters target: all, or all but the routed experts",
    )
    parser.add_argument(
        "--moe-lora-in-gemm",
        choices=("auto", "always", "never"),
        default="auto",
        help="where the routed experts' LoRA expand runs (inference_svc.lora.apply."
        "MOE_LORA_IN_GEMM): auto, or always / never in the grouped GEMM's epilogue (A/B)",
    )
    parser.add_argument(
        "--no-overlap-steps",
        dest="overlap_steps",
        action="store_false",
        help="read each step's tokens back before launching the next (A/B of the overlap)",
    )
    parser.add_argument(
        "--no-breadth-first-admission",
        dest="breadth_first_admission",
        action="store_false",
        help="admit repeat requests of ready adapters while others' slot copies land "
        "(SchedulerConfig.breadth_first_admission off; A/B of the first wave's breadth)",
    )
    parser.add_argument(
        "--step-graph-max-tokens", type=int, default=DEFAULT_STEP_GRAPH_MAX_TOKENS,
        help="largest step with prompt tokens replayed as piecewise step graphs (0: eager)",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, short runs")


@dataclass(frozen=True)
class ServeBenchConfig:
    """One engine of the serving benchmarks. `smoke`: tiny shapes in float32 on the CPU."""

    layers: int = FULL_LAYERS
    rank: int = 16  # the pool's max_lora_rank and the adapters' rank
    prompt_len: int = 512
    output_len: int = 128
    max_num_seqs: int = 128
    max_batch_tokens: int = 8192
    max_loras: int = 64  # slots, or fewer when the device memory left holds fewer
    max_queue: int = 4096
    distinct_weights: int = 2  # distinct adapter weight sets behind all adapter names
    experts: str = "bf16"  # routed experts' weights: bf16 or fp8 (block-quantized)
    adapter_modules: str = "all"  # a key of ADAPTER_MODULES
    moe_lora_in_gemm: str = "auto"  # inference_svc.lora.apply.MOE_LORA_IN_GEMM
    overlap_steps: bool = True  # RuntimeConfig.overlap_steps
    breadth_first_admission: bool = True  # RuntimeConfig.breadth_first_admission
    step_graph_max_tokens: int = DEFAULT_STEP_GRAPH_MAX_TOKENS  # RuntimeConfig's
    smoke: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "rank", "prompt_len", "output_len", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_loras", "max_queue", "distinct_weights"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_batch_tokens < self.max_num_seqs:
            raise ValueError("max_batch_tokens must be >= max_num_seqs")
        if self.experts not in EXPERT_WEIGHTS:
            raise ValueError(f"experts must be one of {EXPERT_WEIGHTS}, got {self.experts!r}")
        if self.adapter_modules not in ADAPTER_MODULES:
            raise ValueError(f"adapter_modules must be one of {sorted(ADAPTER_MODULES)}")

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, smoke_max_batch_tokens: int, smoke_max_loras: int
    ) -> ServeBenchConfig:
        """The config `add_engine_args`' flags describe; `--smoke` swaps in tiny shapes."""
        if not args.smoke:
            return cls(
                layers=args.layers,
                rank=args.rank,
                prompt_len=args.prompt_len,
                output_len=args.output_len,
                max_num_seqs=args.max_num_seqs,
                max_batch_tokens=args.max_batch_tokens,
                max_loras=args.max_loras,
                experts=args.experts,
                adapter_modules=args.adapter_modules,
                moe_lora_in_gemm=args.moe_lora_in_gemm,
                overlap_steps=args.overlap_steps,
                breadth_first_admission=args.breadth_first_admission,
                step_graph_max_tokens=args.step_graph_max_tokens,
            )
        return cls(
            layers=2,
            rank=4,
            prompt_len=16,
            output_len=4,
            max_num_seqs=4,
            max_batch_tokens=smoke_max_batch_tokens,
            max_loras=smoke_max_loras,
            experts=args.experts,
            adapter_modules=args.adapter_modules,
            moe_lora_in_gemm=args.moe_lora_in_gemm,
            overlap_steps=args.overlap_steps,
            breadth_first_admission=args.breadth_first_admission,
            smoke=True,
        )

    @property
    def device(self) -> str:
        return "cpu" if self.smoke else "cuda"

    @property
    def dtype(self) -> str:
        return "float32" if self.smoke else "bfloat16"

    @property
    def hf_config(self) -> dict[str, Any]:
        return {**v2_lite_config(self.layers, self.smoke), "max_position_embeddings": 4096}

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + self.output_len


def build_model(config: ServeBenchConfig) -> DeepseekV3Model:
    """The random-weight model, built once per process and shared by every engine."""
    dtype = torch.float32 if config.smoke else torch.bfloat16
    model = random_model(parse_config(config.hf_config), torch.device(config.device), dtype)
    if config.experts != "bf16":
        quantize_routed_experts(model, fp8_block(config.smoke), config.experts)
    return model


def model_label(config: ServeBenchConfig) -> str:
    """What the JSONs call the model: shape, and the routed experts' weights."""
    experts = {
        "bf16": "bf16",
        "fp8": "FP8 block-quantized routed experts",
        "fp8_a8": "FP8 block-quantized routed experts, e4m3 activations per 128-group",
    }[config.experts]
    return f"random DeepSeek-V2-Lite shape, q_lora_rank 1536, {experts}"


def adapters_label(config: ServeBenchConfig) -> str:
    """What the JSONs say the adapters target."""
    if config.adapter_modules == "all":
        return "every module, routed experts per expert"
    return "every module but the routed experts (MLA, dense and shared-expert MLP)"


def lora_memory_gb(model: DeepseekV3Model, config: ServeBenchConfig) -> float | None:
    """Device memory for the LoRA pool: what weights, KV cache and the activation reserve
    leave (None on the CPU: `max_loras` alone sizes the pool)."""
    if config.smoke:
        return None
    free, _total = torch.cuda.mem_get_info()
    c = model.config
    kv_pages = config.max_num_seqs * pages_for(config.max_model_len, 16)
    kv_bytes = kv_pages * 16 * c.num_layers * c.kv_cache_dim * model.embed.weight.element_size()
    budget = (free - kv_bytes) / GIB - ACTIVATION_RESERVE_GB
    if budget <= 0:
        raise RuntimeError(f"no device memory left for a LoRA pool ({free / GIB:.1f} GiB free)")
    return budget


def build_engine(
    model: DeepseekV3Model, config: ServeBenchConfig, library: AdapterLibrary
) -> LLMEngine:
    """The serving engine (pool of rank `config.rank`, decode graphs captured on CUDA)."""
    apply.MOE_LORA_IN_GEMM = config.moe_lora_in_gemm  # process-wide: one engine per bench
    runtime_config = RuntimeConfig(
        model="random",
        base_model_name=BASE_MODEL,
        device=config.device,
        dtype=config.dtype,
        max_loras=config.max_loras,
        max_lora_rank=config.rank,
        lora_memory_gb=lora_memory_gb(model, config),
        host_cache_gb=HOST_CACHE_LOGICAL_GB,
        host_arena_gb=0.25 if config.smoke else HOST_ARENA_GB,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_batch_tokens=config.max_batch_tokens,
        max_queue=config.max_queue,
        cuda_graphs=not config.smoke,
        overlap_steps=config.overlap_steps,
        breadth_first_admission=config.breadth_first_admission,
        step_graph_max_tokens=config.step_graph_max_tokens,
    )
    source = LocalFileSource(library)
    return assemble_engine(runtime_config, model, config.hf_config, source, InferenceMetrics())


class AdapterLibrary:
    """`distinct` random canonical adapters as local files, and adapter names mapped onto
    them: name `f"{prefix}-{i}"` uses weight set `i % distinct`."""

    def __init__(self, folder: Path, config: ServeBenchConfig) -> None:
        self.folder = folder
        self.rank = config.rank
        self.distinct = config.distinct_weights
        self.dtype = torch.float32 if config.smoke else torch.bfloat16
        self.pin = not config.smoke
        self._manifests: list[Manifest] = []
        self._pinned: dict[int, CanonicalAdapter] = {}
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(self.distinct):
            adapter = random_adapter(
                config.hf_config,
                config.rank,
                modules=ADAPTER_MODULES[config.adapter_modules],
                dtype=self.dtype,
                seed=index,
                base_model=BASE_MODEL,
                std=ADAPTER_STD,
                device=config.device,
            )
            weights, manifest_json = serialize(adapter)
            (self._set_folder(index) / "weights.safetensors").write_bytes(weights)
            (self._set_folder(index) / "manifest.json").write_bytes(manifest_json)
            self._manifests.append(adapter.manifest)

    def _set_folder(self, index: int) -> Path:
        path = self.folder / f"set{index}"
        path.mkdir(exist_ok=True)
        return path

    @property
    def adapter_bytes(self) -> int:
        return self._manifests[0].size_bytes

    def weight_set(self, name: str) -> int:
        return int(name.rsplit("-", 1)[1]) % self.distinct

    def binding(self, name: str) -> AdapterBinding:
        manifest = self._manifests[self.weight_set(name)]
        return AdapterBinding(
            TENANT, name, 1, self.rank, manifest.sha256, manifest.size_bytes, BASE_MODEL
        )

    def read(self, name: str) -> CanonicalAdapter:
        """The adapter's files as they are on disk (what a fetch from a local tier does)."""
        folder = self._set_folder(self.weight_set(name))
        manifest = Manifest.from_json((folder / "manifest.json").read_bytes())
        return CanonicalAdapter(manifest, load_file(folder / "weights.safetensors"))

    def _pinned_set(self, index: int, packing: SlotPacking | None) -> CanonicalAdapter:
        """Weight set `index` read once into (pinned) host memory in the pool's dtype, packed
        in the pool's layout when the host cache packs (as the engine's does)."""
        if index not in self._pinned:
            adapter = self.read(f"set-{index}")
            tensors = {n: t.to(self.dtype).contiguous() for n, t in adapter.tensors.items()}
            adapter = CanonicalAdapter(adapter.manifest, tensors)
            if packing is not None:
                adapter = packing.pack(adapter, pin=self.pin)
            elif self.pin:
                adapter = CanonicalAdapter(
                    adapter.manifest, {n: t.pin_memory() for n, t in tensors.items()}
                )
            self._pinned[index] = adapter
        return self._pinned[index]

    def preload(self, engine: LLMEngine, names: list[str]) -> None:
        """Put `names` into the host cache (aliasing their weight sets, no copy), as if
        each had been fetched; none is in a GPU slot yet."""
        residency = engine.scheduler.residency
        for name in names:
            binding = self.binding(name)
            shared = self._pinned_set(self.weight_set(name), residency.host_cache.packing)
            residency.pool.check_compatible(shared)
            entry = replace(shared, manifest=replace(shared.manifest))
            stored = residency.host_cache.insert(binding.key, entry)
            residency.host_cache.release(binding.key)
            residency.bindings[binding.key] = binding
            some = next(iter(shared.tensors))
            if stored.tensors[some].data_ptr() != shared.tensors[some].data_ptr():
                raise RuntimeError(
                    "the host cache copied a preloaded adapter instead of aliasing it: "
                    "1000 names would need 1000 copies of host memory"
                )

    def discard(self, engine: LLMEngine, names: list[str]) -> None:
        """Drop `names` from the host cache (their GPU slots go by LRU)."""
        cache = engine.scheduler.residency.host_cache
        for name in names:
            cache.discard(self.binding(name).key)


class LocalFileSource(OwnedTensorsSource):
    """The adapter source of the benchmarks: canonical files in a local folder (read, parsed;
    the sha256 check of a download is timed by `bench.serve_cold_path`)."""

    tier = "local"

    def __init__(self, library: AdapterLibrary) -> None:
        self.library = library

    def fetch(self, adapter: AdapterBinding) -> CanonicalAdapter:
        return self.library.read(adapter.name)


def adapter_names(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(count)]


def draw_popularity(num_adapters: int, popularity: str, count: int, seed: int) -> list[int]:
    """`count` adapter indices: uniform, or zipf(1.1) (index i has weight 1 / (i+1)^1.1)."""
    if popularity == "uniform":
        weights = [1.0] * num_adapters
    elif popularity == "zipf":
        weights = [1.0 / (i + 1) ** ZIPF_EXPONENT for i in range(num_adapters)]
    else:
        raise ValueError(f"popularity must be uniform or zipf, got {popularity!r}")
    return random.Random(seed).choices(range(num_adapters), weights, k=count)


_DECODER = ByteTokenizer()


def make_request(
    request_id: str,
    config: ServeBenchConfig,
    vocab_size: int,
    seed: int,
    adapter: AdapterBinding | None,
    sink: OutputSink | None = None,
) -> Sequence:
    """A request of `prompt_len` random tokens generating exactly `output_len` (greedy)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab_size) for _ in range(config.prompt_len)]
    params = GenerationParams(max_new_tokens=config.output_len, ignore_eos=True)
    return Sequence(request_id, prompt, params, _DECODER, (), adapter, sink)


def percentiles_ms(seconds: list[float]) -> dict[str, float | int]:
    """p50/p99/mean of a list of durations in seconds, as milliseconds (NaN when empty)."""
    if not seconds:
        return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "mean_ms": float("nan")}
    values = np.asarray(seconds) * 1e3
    return {
        "n": len(seconds),
        "p50_ms": float(np.percentile(values, 50)),
        "p99_ms": float(np.percentile(values, 99)),
        "mean_ms": float(values.mean()),
    }


def synchronize(config: ServeBenchConfig) -> None:
    if not config.smoke:
        torch.cuda.synchronize()


def save(path: Path, results: dict[str, Any]) -> None:
    """Write the results so far (called after every scenario: a killed run keeps them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=float))


def host_bytes_note(library: AdapterLibrary) -> str:
    return (
        f"{library.distinct} distinct weight sets of {library.adapter_bytes / 1e6:.0f} MB "
        "behind every adapter name (host entries alias them; each name has its own slot load)"
    )
