"""Builds the serving runtime of one replica from its config: model, KV cache, LoRA slot
pool, adapter tiers, scheduler and engine. The service edge (`__main__`) and the tests both
build through here, so they run the same wiring."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adapter_store.model_shapes import model_lora_shapes
from inference_svc.adapters.host_cache import HostAdapterCache, HostCacheConfig
from inference_svc.adapters.residency import AdapterResidency
from inference_svc.adapters.sources import AdapterSource
from inference_svc.engine.engine import LLMEngine
from inference_svc.engine.kv_pages import pages_for
from inference_svc.engine.lora_slots import LoraSlotAllocator
from inference_svc.engine.model_runner import ModelRunner, RunnerConfig
from inference_svc.engine.scheduler import Scheduler, SchedulerConfig
from inference_svc.engine.warm_up import warm_up_prefill
from inference_svc.lora.pool import GIB, LoraPool, LoraPoolConfig, check_lora_budget
from inference_svc.metrics import InferenceMetrics
from inference_svc.model.loader import check_expert_activations, load_model
from inference_svc.model.tiny import model_folder
from inference_svc.model.tokenizer import Tokenizer
from inference_svc.models.deepseek_v3 import DeepseekV3Model

log = logging.getLogger("loraserve.runtime")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# RuntimeConfig.step_graph_max_tokens' default: an online step of a few prompts beside the
# running decodes; longer steps keep the GPU busy eagerly.
DEFAULT_STEP_GRAPH_MAX_TOKENS = 2048


@dataclass(frozen=True)
class RuntimeConfig:
    model: str  # HF folder, or "tiny" for the embedded demo model
    base_model_name: str  # the store's name of this base model; adapters must name it
    device: str = "cpu"
    dtype: str = "float32"
    max_loras: int = 8  # GPU slots (the memory budget may allow fewer)
    max_lora_rank: int = 16
    lora_memory_gb: float | None = None
    # Or the slots' budget as a fraction of the device's free memory at start-up.
    lora_memory_fraction: float | None = None
    host_cache_gb: float = 2.0
    # Pinned arena the host cache packs fetched adapters into, allocated at start-up;
    # None: host_cache_gb (the whole cache). Benchmarks whose entries alias a few weight
    # sets give the cache a huge logical size and the arena a real one.
    host_arena_gb: float | None = None
    kv_pages: int = 0  # 0: enough for max_num_seqs sequences of max_model_len
    page_size: int = 16
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    max_num_seqs: int = 32
    max_batch_tokens: int = 512
    max_queue: int = 256
    cuda_graphs: bool = True  # capture decode graphs on CUDA (and the step graphs)
    # Largest step with prompt tokens (or more decodes than the decode graphs hold) that
    # replays piecewise step graphs (engine/step_graphs.py) rather than launching every
    # kernel; 0: such steps run eagerly.
    step_graph_max_tokens: int = DEFAULT_STEP_GRAPH_MAX_TOKENS
    # Launch step n+1 before reading step n's tokens back (engine.py); False reads each
    # step back at once (A/B, debugging).
    overlap_steps: bool = True
    # SchedulerConfig.breadth_first_admission: while the adapters outnumber the slots, one
    # admission pass a step while waiting adapters' slot copies land (a wider wave of
    # requests; a step's budget may go partly unused).
    breadth_first_admission: bool = True
    # The routed experts' activations in their GEMMs (loader.EXPERT_ACTIVATIONS): "e4m3" is
    # DeepSeek-V3's FP8 scheme (FP8 checkpoints on CUDA only), "bf16" the exact GEMM.
    expert_activations: str = "bf16"
    warm_up: bool = True  # compile every prefill shape class's kernels at start (CUDA)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not self.base_model_name:
            raise ValueError("base_model_name must be set")
        for name in ("max_loras", "max_lora_rank", "page_size", "max_num_seqs", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_expert_activations(self.expert_activations)
        for name in ("kv_pages", "max_model_len", "step_graph_max_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: automatic), got {getattr(self, name)}")
        check_lora_budget(self.lora_memory_gb, self.lora_memory_fraction)
        if self.host_cache_gb <= 0:
            raise ValueError(f"host_cache_gb must be > 0, got {self.host_cache_gb}")
        if self.host_arena_gb is not None and self.host_arena_gb < 0:
            raise ValueError(f"host_arena_gb must be >= 0, got {self.host_arena_gb}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class Runtime:
    config: RuntimeConfig
    engine: LLMEngine
    tokenizer: Tokenizer
    hf_config: dict[str, Any]
    metrics: InferenceMetrics

    @property
    def residency(self) -> AdapterResidency:
        return self.engine.scheduler.residency


def build_runtime(
    config: RuntimeConfig,
    source: AdapterSource | None,
    metrics: InferenceMetrics | None = None,
    on_fetched: Callable[[], None] = lambda: None,
) -> Runtime:
    """Load the model and assemble the engine (the engine thread is started by the caller)."""
    metrics = metrics or InferenceMetrics()
    folder = model_folder(config.model)
    hf_config = json.loads((folder / "config.json").read_text())
    loaded = load_model(
        folder, config.device, config.torch_dtype, expert_activations=config.expert_activations
    )
    engine = assemble_engine(config, loaded.model, hf_config, source, metrics, on_fetched)
    log.info(
        "model %s (%s, %s on %s): max model len %d, %d KV pages of %d tokens",
        config.base_model_name,
        Path(folder).name,
        config.dtype,
        config.device,
        engine.scheduler.config.max_model_len,
        engine.scheduler.config.num_pages,
        config.page_size,
    )
    return Runtime(config, engine, loaded.tokenizer, hf_config, metrics)


def step_graph_sizes(max_tokens: int) -> tuple[int, ...]:
    """Token counts of the step graphs up to `max_tokens` (0: none): powers of two to 128,
    then every 128 to 1024, then every 256. A step runs padded to the next size, so the
    spacing bounds the padding's work (a 544-token step: 640, +18 %) against the capture
    time and graphs a size adds."""
    sizes = [s for s in (16, 32, 64) if s < max_tokens]
    size = 128
    while size < max_tokens:
        sizes.append(size)
        size += 128 if size < 1024 else 256
    return (*sizes, max_tokens) if max_tokens else ()


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Decode graphs worth capturing: powers of two up to the first that holds
    `max_num_seqs` (larger ones never replay, and each costs capture time and memory)."""
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def assemble_engine(
    config: RuntimeConfig,
    model: DeepseekV3Model,
    hf_config: dict[str, Any],
    source: AdapterSource | None,
    metrics: InferenceMetrics,
    on_fetched: Callable[[], None] = lambda: None,
) -> LLMEngine:
    """KV cache, LoRA slot pool, adapter tiers, scheduler and engine around a built model
    (the service loads it from a checkpoint; benchmarks build random weights)."""
    max_model_len = config.max_model_len or model.config.max_position_embeddings
    kv_pages = config.kv_pages or config.max_num_seqs * pages_for(max_model_len, config.page_size)
    pool = LoraPool.from_config(
        model_lora_shapes(hf_config),
        LoraPoolConfig(
            max_lora_rank=config.max_lora_rank,
            dtype=config.torch_dtype,
            device=config.device,
            max_loras=config.max_loras,
            lora_memory_gb=config.lora_memory_gb,
            lora_memory_fraction=config.lora_memory_fraction,
        ),
    )
    step_tokens = max(config.max_batch_tokens, config.max_num_seqs)  # a step's token budget
    runner = ModelRunner(
        model,
        RunnerConfig(
            num_pages=kv_pages,
            page_size=config.page_size,
            max_pages_per_seq=pages_for(max_model_len, config.page_size),
            cuda_graph_batch_sizes=graph_batch_sizes(config.max_num_seqs),
            step_graph_token_sizes=step_graph_sizes(min(config.step_graph_max_tokens, step_tokens)),
        ),
        lora_pool=pool,
    )
    if config.device == "cuda" and config.cuda_graphs:
        began = time.perf_counter()
        runner.capture_decode_graphs()
        decode_s = time.perf_counter() - began
        runner.capture_step_graphs()
        log.info(
            "CUDA graphs captured: decode steps of %s rows in %.1f s, step graphs of %s tokens "
            "in %.1f s",
            runner.config.cuda_graph_batch_sizes, decode_s,
            runner.config.step_graph_token_sizes, time.perf_counter() - began - decode_s,
        )  # fmt: skip
    if config.device == "cuda" and config.warm_up:
        warm_up_prefill(runner, step_tokens, max_model_len, config.max_num_seqs)
    # Packing at insert makes a slot load a few large copies instead of one per tensor.
    arena_gb = config.host_arena_gb  # None: the arena is the whole cache
    host_cache = HostAdapterCache(
        HostCacheConfig(
            capacity_bytes=int(config.host_cache_gb * GIB),
            dtype=config.torch_dtype,
            arena_bytes=None if arena_gb is None else int(arena_gb * GIB),
        ),
        pool.packing,
    )
    residency = AdapterResidency(source, host_cache, pool, metrics, on_fetched)
    scheduler = Scheduler(
        SchedulerConfig(
            num_pages=kv_pages,
            page_size=config.page_size,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=step_tokens,
            max_waiting=config.max_queue,
            breadth_first_admission=config.breadth_first_admission,
        ),
        LoraSlotAllocator(pool.num_slots),
        residency,
        metrics,
    )
    return LLMEngine(runner, scheduler, metrics, overlap_steps=config.overlap_steps)
