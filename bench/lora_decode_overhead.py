"""Whole-step LoRA overhead: decode step with 32 distinct rank-16 (`--rank`) adapters vs no LoRA.

A DeepSeek-V2-Lite-shaped model with random bf16 weights and `q_lora_rank` 1536 (so
attn.qkv_a has its two unequal slices and attn.q_b exists), `--layers` decoder layers (default
8 = 1 dense + 7 MoE of V2-Lite's 27, to keep memory and the run short; the overhead is a
per-layer ratio, `--layers 27` gives the full model). Adapters cover every canonical module
and are written straight into the slot pool with random values (the load path is not what
is timed; `--no-routed`: on every module but the routed experts, which most MoE fine-tunes
leave alone). Decode steps are CUDA-graph replays through `ModelRunner.execute` at batch
1 / 64 / 256, each sequence with `--context` cached tokens, timed like bench.model_decode
(`bench.gpu_timing.time_ms`: warm-up, L2 flush, median).

Each decode case also reports its floor (bench/lora_floor.py): the bytes of LoRA weights
the step must read ÷ the base step's bytes, i.e. the overhead of a step whose LoRA kernels
read as efficiently as its base kernels, the time LoRA adds ÷ those bytes at the
measured copy bandwidth, and the LoRA step ÷ its floor as issue 9 defines it (the bytes of
the base step and of the batch's adapters at the copy bandwidth; goal ≤ 1.5).

Also the MoE LoRA cost on its own: one MoE layer at batch 64, 8 adapters, as
(t_with_lora − t_base) ÷ t_base, both as CUDA-graph replays.

Goals (TARGETS.md / issue 6): overhead ≤ 15% (throughput ratio ≥ 0.90 in TARGETS), MoE LoRA
cost ≤ 0.25.

`--variants` times several kernel sets side by side on one model and pool (graphs are
recaptured per set, the no-LoRA step is timed again each time: the spread of the base
times is the run's noise). `v1` is the kernels as first measured, `serial` the defaults
with every LoRA kernel on the step's own stream, `new` the defaults. The ablations
(`no_attn_lora`, `no_kv_b_lora`, `no_attn_linear_lora`, `no_mlp_lora`, `no_moe_lora`) leave
one group of modules' LoRA out: the time a group's absence saves is its share of the LoRA
step. The skips (`skip_expand`, `skip_kv_b_q`, `skip_kv_b_o`) drop one kernel, for timing
only: what they save bounds what a faster or hidden kernel could gain.

    python -m bench.lora_decode_overhead --out bench/results/lora_decode_overhead.json \
        --variants v1 new
    python -m bench.lora_decode_overhead --smoke   # CPU: the same setup at tiny sizes
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from adapter_store.format import model_lora_shapes
from adapter_store.model_shapes import is_routed_expert_module
from bench.gpu_timing import copy_bandwidth, device_name, time_ms
from bench.lora_floor import lora_step_bytes, tokens_per_slot
from bench.model_decode import SMOKE_OVERRIDES, V2_LITE_Q_LORA, random_model, step_bytes
from bench.provenance import provenance
from bench.step_profile import profile_step
from inference_svc.engine.batch import BatchMetadata, SequenceStep, build_batch
from inference_svc.engine.kv_pages import pages_for
from inference_svc.engine.model_runner import ModelRunner, RunnerConfig
from inference_svc.lora import apply
from inference_svc.lora.attach import lora_targets
from inference_svc.lora.pool import LoraPool, LoraPoolConfig
from inference_svc.model.config import parse_config
from inference_svc.models import deepseek_v3 as model_module
from kernels import fused_moe
from kernels import moe_lora as moe_lora_module
from kernels.lora_segments import build_lora_segments
from kernels.mla_lora import mla_kv_b_lora_o
from kernels.moe_lora import moe_lora_down, moe_lora_gate_up
from kernels.sgmv import sgmv_shrink

BATCHES = (1, 64, 256)
NUM_ADAPTERS = 32
RANK = 16
MOE_BATCH, MOE_ADAPTERS = 64, 8
# A serving prefill step: bench.serve_offline's 8192-token budget of 512-token prompts.
PREFILL_SEQS = 16
PREFILL_WARMUP_STEPS = 3
PAGE_SIZE = 16
GOAL_OVERHEAD, GOAL_MOE_RATIO = 0.15, 0.25


def _nothing(*args: Any, **kwargs: Any) -> None:
    """Stands in for a launcher that is skipped, or a side stream that is not used."""
    return None


def _zero_kv_b_q(q_nope: torch.Tensor, q_lat: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """kv_b's query correction skipped: q_lat zeroed (the product is added onto it)."""
    q_lat.zero_()


# Kernel sets: (module, attribute) -> what it is replaced with (a launcher, or a setting
# such as MOE_LORA_IN_GEMM); `apply` is inference_svc.lora.apply.
# v1: the MoE LoRA "runs" kernels, every LoRA kernel on the step's stream; serial: today's
# kernels, every LoRA kernel on the step's stream; new: the defaults (linear modules'
# shrinks on the side stream, beside the base matmuls; the shared experts beside the routed).
KERNEL_SETS: dict[str, dict[tuple[ModuleType, str], Any]] = {
    "v1": {
        (apply, "moe_lora_gate_up"): functools.partial(moe_lora_gate_up, variant="runs"),
        (apply, "moe_lora_down"): functools.partial(moe_lora_down, variant="runs"),
        (apply, "lora_side_stream"): _nothing,
        (model_module, "SHARED_EXPERTS_STREAM_MAX_TOKENS"): 0,
    },
    "serial": {
        (apply, "lora_side_stream"): _nothing,
        (model_module, "SHARED_EXPERTS_STREAM_MAX_TOKENS"): 0,
    },
    "new": {},
    # The defaults with the shared experts after the routed experts, on the step's stream.
    "shared_serial": {(model_module, "SHARED_EXPERTS_STREAM_MAX_TOKENS"): 0},
    # The defaults with the shared experts forked before the router runs, at every batch.
    "fork_first": {(model_module, "ROUTE_BEFORE_FORK_MIN_TOKENS"): 2**31},
    # The defaults with the MoE LoRA "runs" kernels at every batch: pairs walked in the
    # base MoE's expert order, one read of each (adapter, expert) key per block of pairs.
    "moe_runs": {
        (apply, "moe_lora_gate_up"): functools.partial(moe_lora_gate_up, variant="runs"),
        (apply, "moe_lora_down"): functools.partial(moe_lora_down, variant="runs"),
    },
    # The routed experts' LoRA expand always after the grouped GEMM (the defaults before the
    # GEMM epilogue: "pairs" at decode, "runs" at prefill), or always in its epilogue.
    "moe_after": {(apply, "MOE_LORA_IN_GEMM"): "never"},
    "moe_in_gemm": {(apply, "MOE_LORA_IN_GEMM"): "always"},
    # The prompt-step MoE LoRA shrink with one K loop per (adapter, expert) key of a pair
    # block (before the first keys shared one: kernels.moe_lora.SHRINK_KEYS_FROM_ROWS).
    "moe_shrink_per_key": {(moe_lora_module, "SHRINK_KEYS_FROM_ROWS"): {}},
    # The prompt-step grouped GEMM plans before the thirty-first session: bf16 gate_up 3
    # stages deep, and FP8 gate_up's 256-wide tiles without the LoRA epilogue too.
    "prefill_tiles_s30": {
        (fused_moe, "PREFILL_TILES"): {
            **fused_moe.PREFILL_TILES,
            "float": {
                "gate_up": fused_moe.GemmTiles(block_n=256, block_k=64, num_warps=8, num_stages=3),
                "down": fused_moe.PREFILL_TILES["float"]["down"],
            },
        },
        (fused_moe, "PREFILL_TILES_WITHOUT_LORA"): {},
    },
    # Every step's linear shrinks on the side stream beside the base products (the defaults
    # put them inside the products of the carried weights in steps of as many tokens as
    # the pool has slots: apply.shrinks_in_product).
    "shrink_beside_product": {(apply, "SHRINK_IN_PRODUCT_MAX_TOKENS"): 0},
    # The linear modules' shrinks with fewer K splits (fewer float32 atomics).
    "shrink_p2": {(apply, "sgmv_shrink"): functools.partial(sgmv_shrink, variant="planned_p2")},
    "shrink_p1": {(apply, "sgmv_shrink"): functools.partial(sgmv_shrink, variant="planned_p1")},
    # One-token steps through cuBLAS and the separate LoRA kernels (the shrink beside the
    # product on the side stream, then the expand; kv_b's corrections as their own launches)
    # instead of kernels.gemv with the LoRA in its launches.
    "one_token_cublas": {(apply, "ONE_TOKEN_LORA_IN_GEMV"): False},
    # kv_b's output correction as its own launch after W_UV's product (not in the merge)
    # with whole weight tiles read at once, before its PDL wait ("prefetch"), or one program
    # per (segment, head) item ("v1"), instead of "planned" (16 programs an SM walking the
    # items, weights in 128-row chunks).
    **{
        f"kv_b_o_{v}": {
            (apply, "mla_kv_b_lora_o"): functools.partial(mla_kv_b_lora_o, variant=v),
            (apply, "KV_B_O_IN_MERGE"): False,
        }
        for v in ("prefetch", "v1")
    },
    # kv_b's output correction as its own launch after W_UV's product in decode steps whose
    # attention runs the split merge (before the merge wrote it: apply.KV_B_O_IN_MERGE).
    "kv_b_o_separate": {(apply, "KV_B_O_IN_MERGE"): False},
    # q_b's expand and kv_b's query correction as two launches in decode steps (before one
    # launch did both: kernels.mla_q_lora).
    "q_b_kv_b_q_separate": {(apply, "Q_B_EXPAND_WITH_KV_B_Q"): False},
    # Kernel skips, for timing only (the LoRA's result is wrong): kv_b's query correction
    # (a memset instead), its output correction, and every linear module's SGMV expand.
    # What a skip saves bounds what a faster or hidden kernel could gain.
    "skip_kv_b_q": {
        (apply, "mla_kv_b_lora_q"): _zero_kv_b_q,
        (apply, "Q_B_EXPAND_WITH_KV_B_Q"): False,
    },
    "skip_kv_b_o": {(apply, "mla_kv_b_lora_o"): _nothing, (apply, "KV_B_O_IN_MERGE"): False},
    "skip_expand": {(apply, "sgmv_expand"): _nothing},
    # Prompt steps with a gated MLP's gate_up LoRA expand as its own launch before SiLU·mul
    # (the defaults add it in the activation's launch: kernels.gated_expand).
    "gate_up_expand_separate": {(apply, "GATE_UP_EXPAND_WITH_SILU_MIN_TOKENS"): 2**31},
}


# Ablations: one group of modules' LoRA left out (its pool views detached from the model,
# so the captured graphs hold none of its kernels). What the LoRA step loses with a group
# left out is that group's share of the step, measured without a profiler: the torch
# profiler's traces of graph replays stretch a chain of small launches (twenty-third
# session: a fold the trace put at −52 µs a step measured −7 to −11 µs).
ABLATIONS: dict[str, tuple[str, ...]] = {
    "no_attn_lora": ("attn.",),
    "no_kv_b_lora": ("attn.kv_b",),  # kv_b's absorbed corrections (and its prefill delta)
    "no_attn_linear_lora": ("attn.qkv_a", "attn.q", "attn.o"),  # "attn.q" covers q_b
    "no_mlp_lora": ("mlp.",),  # the dense layer's MLP and the shared experts
    "no_moe_lora": ("moe.",),  # the routed experts
}


@contextlib.contextmanager
def lora_detached(model: model_module.DeepseekV3Model, prefixes: tuple[str, ...]) -> Iterator[None]:
    """Inside the block, the LoRA modules whose canonical names start with `prefixes` have
    no pool views (their layers compute the base model only)."""
    detached = [
        (owner, attribute, getattr(owner, attribute))
        for _, module, owner, attribute in lora_targets(model)
        if module.startswith(prefixes)
    ]
    for owner, attribute, _ in detached:
        setattr(owner, attribute, None)
    try:
        yield
    finally:
        for owner, attribute, weights in detached:
            setattr(owner, attribute, weights)


def variant(name: str, model: model_module.DeepseekV3Model) -> contextlib.AbstractContextManager:
    """A kernel set (KERNEL_SETS) or an ablation (ABLATIONS) by name."""
    return kernel_set(name) if name in KERNEL_SETS else lora_detached(model, ABLATIONS[name])


@contextlib.contextmanager
def kernel_set(name: str) -> Iterator[None]:
    """Route the model's LoRA deltas through the launchers (and settings) of set `name`."""
    chosen = KERNEL_SETS[name]
    saved = {target: getattr(*target) for target in chosen}
    for (module, attr), replacement in chosen.items():
        setattr(module, attr, replacement)
    try:
        yield
    finally:
        for (module, attr), value in saved.items():
            setattr(module, attr, value)


def v2_lite_config(layers: int, smoke: bool = False) -> dict[str, Any]:
    """V2-Lite's shape with q_lora_rank 1536 (as bench.model_decode) and `layers` layers."""
    return {**V2_LITE_Q_LORA, **(SMOKE_OVERRIDES if smoke else {}), "num_hidden_layers": layers}


@dataclass
class Setup:
    runner: ModelRunner
    context: int
    num_slots: int
    routed_adapters: bool = True  # the adapters target the routed experts too

    @property
    def model(self) -> model_module.DeepseekV3Model:
        return self.runner.model


def fill_pool(pool: LoraPool, num_adapters: int, routed: bool = True) -> None:
    """Random rank-`pool.max_rank` adapters on every module (`routed` False: every module
    but the routed experts') in slots [0, num_adapters).

    The per-module ranks are what the kernels read (a module whose rank is 0 skips its
    work): set with the slot ranks, as `LoraPool.load` does from a manifest.
    """
    generator = torch.Generator(device=pool.device).manual_seed(1)
    with torch.no_grad():
        for layer, module in pool.module_instances():
            targeted = routed or not is_routed_expert_module(module)
            for buffer in (pool.lora_a(layer, module), pool.lora_b(layer, module)):
                if targeted:
                    buffer[:num_adapters].normal_(0.0, 0.02, generator=generator)
            pool.rank_of(layer, module)[:num_adapters] = pool.max_rank if targeted else 0
        pool.slot_rank[:num_adapters] = pool.max_rank
    pool.slot_rank_host[:num_adapters] = [pool.max_rank] * num_adapters
    pool.slot_routed_host[:num_adapters] = [routed] * num_adapters


def make_setup(
    hf_config: dict[str, Any],
    device: str,
    context: int,
    batches: tuple[int, ...],
    graphs: bool,
    rank: int = RANK,
    routed: bool = True,
) -> Setup:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = random_model(parse_config(hf_config), torch.device(device), dtype)
    shapes = model_lora_shapes(hf_config)
    pool_config = LoraPoolConfig(rank, dtype=dtype, device=device, max_loras=NUM_ADAPTERS)
    pool = LoraPool(shapes, NUM_ADAPTERS, pool_config)
    fill_pool(pool, NUM_ADAPTERS, routed)
    # Enough for the largest decode batch and for the prefill step's sequences.
    pages = max(*batches, PREFILL_SEQS) * pages_for(context, PAGE_SIZE)
    runner_config = RunnerConfig(
        num_pages=pages,
        page_size=PAGE_SIZE,
        max_pages_per_seq=pages_for(context, PAGE_SIZE),
        cuda_graph_batch_sizes=batches,
    )
    runner = ModelRunner(model, runner_config, pool)
    if graphs:
        runner.capture_decode_graphs()
    return Setup(runner, context, NUM_ADAPTERS, routed)


def case_slots(size: int, adapters: int) -> list[int]:
    """Each sequence's slot: `adapters` distinct slots grouped as the scheduler orders them
    (0 adapters: -1, the base model only)."""
    return [b * adapters // size if adapters else -1 for b in range(size)]


def decode_batch(setup: Setup, size: int, adapters: int) -> tuple[torch.Tensor, BatchMetadata]:
    """`size` decode sequences of `context` tokens with the slots of `case_slots`."""
    per_seq = pages_for(setup.context, PAGE_SIZE)
    steps = []
    for b, slot in enumerate(case_slots(size, adapters)):
        pages = tuple(range(b * per_seq, (b + 1) * per_seq))
        steps.append(SequenceStep(setup.context - 1, 1, pages, lora_slot=slot))
    runner = setup.runner
    batch = build_batch(
        steps, PAGE_SIZE, runner.device, runner.lora_slot_rank, runner.lora_slot_routed
    )
    vocab = setup.model.config.vocab_size
    input_ids = torch.randint(0, vocab, (size,), device=runner.device)
    return input_ids, batch


def graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` captured once as a CUDA graph (after a warm-up that compiles its kernels)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@dataclass
class StepRow:
    batch: int
    adapters: int
    base_us: float
    lora_us: float
    base_bytes: float  # what the base step must read (bench.model_decode.step_bytes)
    lora_bytes: float  # what the adapters add (bench.lora_floor.lora_step_bytes)
    profile: dict[str, Any] | None = None

    @property
    def overhead(self) -> float:
        return self.lora_us / self.base_us - 1.0

    @property
    def floor_overhead(self) -> float:
        """The overhead if the LoRA weights were read as efficiently as the base weights."""
        return self.lora_bytes / self.base_bytes

    def added_over_floor(self, bandwidth: float) -> float:
        """The time LoRA adds ÷ its bytes at the copy bandwidth (bytes/s)."""
        return (self.lora_us - self.base_us) * 1e-6 / (self.lora_bytes / bandwidth)

    def lora_step_over_floor(self, bandwidth: float) -> float:
        """The LoRA step ÷ its floor as issue 9 defines it: the bytes of the base step and
        of the batch's adapters at the copy bandwidth (bytes/s)."""
        return self.lora_us * 1e-6 / ((self.base_bytes + self.lora_bytes) / bandwidth)

    def as_dict(self, bandwidth: float) -> dict[str, Any]:
        return {
            **asdict(self),
            "overhead": self.overhead,
            "floor_overhead": self.floor_overhead,
            "added_over_floor": self.added_over_floor(bandwidth),
            "lora_step_over_floor": self.lora_step_over_floor(bandwidth),
        }


def default_cases(batches: tuple[int, ...], num_slots: int) -> list[tuple[int, int]]:
    """(batch, distinct adapters) per batch size: as many adapters as the batch and the
    slots allow."""
    return [(size, min(size, num_slots)) for size in batches]


def parse_case(text: str) -> tuple[int, int]:
    """'128x8' → (batch 128, 8 distinct adapters)."""
    batch, _, adapters = text.partition("x")
    if not batch.isdigit() or not adapters.isdigit() or int(batch) < 1 or int(adapters) < 1:
        raise argparse.ArgumentTypeError(f"a case is BATCHxADAPTERS, e.g. 128x8; got {text!r}")
    return int(batch), int(adapters)


def measure_steps(setup: Setup, cases: list[tuple[int, int]], profile: bool) -> list[StepRow]:
    """Base and LoRA step per (batch, adapters) case; with `profile`, the µs per kernel
    class of both."""
    rows = []
    for size, adapters in cases:
        adapters = min(adapters, size, setup.num_slots)
        times, profiles = [], {}
        for label, count in (("base", 0), ("lora", adapters)):
            input_ids, batch = decode_batch(setup, size, count)
            step = functools.partial(setup.runner.execute, input_ids, batch)
            times.append(1e3 * time_ms(step, setup.runner.device))
            if profile:
                profiles[label] = profile_step(step, setup.runner.device)
        rows.append(StepRow(size, adapters, *times, *case_bytes(setup, size, adapters),
                            profile=profiles or None))  # fmt: skip
        print(
            f"decode B={size:<4} adapters={adapters:<3} base {times[0]:9.1f} µs  "
            f"LoRA {times[1]:9.1f} µs  overhead {rows[-1].overhead:+.1%} "
            f"(floor {rows[-1].floor_overhead:+.1%})"
        )
    return rows


def case_bytes(setup: Setup, size: int, adapters: int) -> tuple[float, float]:
    """(base bytes, LoRA bytes) a decode step of the case must read."""
    model = setup.model
    pool = setup.runner.lora_pool
    base = sum(step_bytes(model, size, setup.context).values())
    lora = lora_step_bytes(
        pool.shapes,
        pool.max_rank,
        pool.dtype.itemsize,
        tokens_per_slot(case_slots(size, adapters)),
        model.config.routing.top_k,
    )
    return base, lora["linear"] + (lora["routed"] if setup.routed_adapters else 0.0)


def prefill_batch(
    setup: Setup, seqs: int, prompt_len: int, adapters: int
) -> tuple[torch.Tensor, BatchMetadata]:
    """`seqs` whole prompts of `prompt_len` tokens from an empty cache, as the scheduler
    packs a prefill step, with the slots of `case_slots`."""
    per_seq = pages_for(prompt_len, PAGE_SIZE)
    steps = []
    for b, slot in enumerate(case_slots(seqs, adapters)):
        pages = tuple(range(b * per_seq, (b + 1) * per_seq))
        steps.append(SequenceStep(0, prompt_len, pages, lora_slot=slot))
    runner = setup.runner
    batch = build_batch(
        steps, PAGE_SIZE, runner.device, runner.lora_slot_rank, runner.lora_slot_routed
    )
    vocab = setup.model.config.vocab_size
    input_ids = torch.randint(0, vocab, (seqs * prompt_len,), device=runner.device)
    return input_ids, batch


def measure_prefill(setup: Setup, profile: bool) -> list[dict[str, Any]]:
    """A serving prefill step (16 prompts of `context` tokens, eager as the engine runs it)
    without LoRA, with one adapter and with 16; with `profile`, the kernel classes whose
    time LoRA adds (µs per step, largest first)."""
    seqs, rows = PREFILL_SEQS, []
    device = setup.runner.device
    base_profile = None
    for adapters in (0, 1, seqs):
        input_ids, batch = prefill_batch(setup, seqs, setup.context, adapters)
        step = functools.partial(setup.runner.execute, input_ids, batch)
        # time_ms warms up for 10 ms, one call of a step this long, and the process's first
        # prefill case measured 63 % slower than the same case later in the run (cause not
        # traced), so a few untimed steps come first.
        for _ in range(PREFILL_WARMUP_STEPS):
            step()
        us = 1e3 * time_ms(step, device)
        row: dict[str, Any] = {"seqs": seqs, "prompt_len": setup.context, "adapters": adapters,
                               "us": us}  # fmt: skip
        if profile:
            row["profile"] = profile_step(step, device, steps=2)
            if adapters == 0:
                base_profile = row["profile"]
            else:
                row["added_us_by_class"] = added_by_class(base_profile, row["profile"])
        rows.append(row)
        ratio = f"  ÷ no LoRA {us / rows[0]['us']:.3f}" if adapters else ""
        print(f"prefill {seqs}×{setup.context} adapters={adapters:<3} {us:10.1f} µs{ratio}")
        for label, added in list(row.get("added_us_by_class", {}).items())[:8]:
            print(f"    +{added:9.1f} µs  {label}")
    return rows


def added_by_class(base: dict[str, Any] | None, lora: dict[str, Any]) -> dict[str, float]:
    """µs per step each kernel class takes with LoRA beyond the base step, largest first."""
    before = {} if base is None else base["classes"]
    added = {
        label: stats["us_per_step"] - before.get(label, {}).get("us_per_step", 0.0)
        for label, stats in lora["classes"].items()
    }
    return dict(sorted(added.items(), key=lambda kv: kv[1], reverse=True))


def measure_moe(setup: Setup) -> dict[str, float]:
    """One MoE layer at batch 64 with 8 adapters: LoRA cost ÷ base fused MoE."""
    moe = next(layer.moe for layer in setup.model.layers if layer.moe is not None)
    hidden = setup.model.config.hidden_size
    x = torch.randn(MOE_BATCH, hidden, device="cuda", dtype=setup.model.dtype)
    slots = [b * MOE_ADAPTERS // MOE_BATCH for b in range(MOE_BATCH)]
    segs = build_lora_segments(slots, setup.runner.lora_pool.slot_rank, device="cuda")
    device = torch.device("cuda")
    with torch.inference_mode():
        base = 1e3 * time_ms(graphed(lambda: moe(x)), device)
        with_lora = 1e3 * time_ms(graphed(lambda: moe(x, segs)), device)
    ratio = (with_lora - base) / base
    print(
        f"MoE B={MOE_BATCH} adapters={MOE_ADAPTERS}: base {base:.1f} µs, with LoRA "
        f"{with_lora:.1f} µs → LoRA cost ÷ base {ratio:.3f} (goal ≤ {GOAL_MOE_RATIO})"
    )
    return {"batch": MOE_BATCH, "adapters": MOE_ADAPTERS, "base_us": base,
            "lora_us": with_lora, "ratio": ratio}  # fmt: skip


def plot(results: dict[str, Any], png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = results["variants"]
    fig, (ax_t, ax_o) = plt.subplots(1, 2, figsize=(12, 4))
    first = next(iter(variants.values()))["decode"]
    labels = [str(r["batch"]) for r in first]
    xs = range(len(labels))
    width = 0.8 / (len(variants) + 1)
    ax_t.bar(xs, [r["base_us"] for r in first], width, label="no LoRA")
    for i, (name, result) in enumerate(variants.items(), start=1):
        rows = result["decode"]
        shifted = [x + i * width for x in xs]
        ax_t.bar(shifted, [r["lora_us"] for r in rows], width, label=f"LoRA ({name})")
        overheads = [100 * r["overhead"] for r in rows]
        ax_o.bar(shifted, overheads, width, label=f"{name}, MoE {result['moe']['ratio']:.2f}")
    for ax in (ax_t, ax_o):
        ax.set(xticks=list(xs), xticklabels=labels, xlabel="decode batch")
        ax.legend()
    ax_t.set(ylabel="step µs", title=f"decode step, V2-Lite shape, {results['layers']} layers")
    ax_o.axhline(100 * GOAL_OVERHEAD, color="red", linestyle="--")
    ax_o.set(ylabel="LoRA overhead % (goal 15)", title="overhead; legend: MoE LoRA ÷ base (≤ 0.25)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    print(f"plot: {png_path}")


def run(
    out: Path,
    layers: int,
    context: int,
    variants: list[str],
    profile: bool,
    prefill: bool,
    cases: list[tuple[int, int]] | None = None,
    rank: int = RANK,
    routed: bool = True,
) -> None:
    start = time.perf_counter()
    batches = tuple(sorted({size for size, _ in cases})) if cases else BATCHES
    setup = make_setup(
        v2_lite_config(layers), "cuda", context, batches, graphs=False, rank=rank, routed=routed
    )
    bandwidth = copy_bandwidth(torch.device("cuda"))
    cases = cases or default_cases(batches, setup.num_slots)
    measured = {}
    for i, name in enumerate(variants):
        # A fresh runner (same model and pool) captures its graphs with this set. A name
        # given again (alternating A/B runs in one process) gets its position appended.
        key = f"{name}#{i}" if name in variants[:i] else name
        renew_runner(setup)
        with variant(name, setup.model):
            setup.runner.capture_decode_graphs()
            print(f"[{key}] graphs captured at {time.perf_counter() - start:.0f} s")
            rows = measure_steps(setup, cases, profile)
            measured[key] = {
                "decode": [r.as_dict(bandwidth) for r in rows],
                "moe": measure_moe(setup),
            }
            if prefill:
                measured[key]["prefill"] = measure_prefill(setup, profile)
    results = {
        "device": device_name(torch.device("cuda")),
        **provenance("lora_decode_overhead"),
        "model": "DeepSeek-V2-Lite shape, q_lora_rank 1536, random bf16 weights",
        "layers": layers,
        "context": context,
        "rank": rank,
        "num_adapters": NUM_ADAPTERS,
        "adapter_modules": "all" if routed else "all but the routed experts",
        "copy_bandwidth_bytes_per_s": bandwidth,
        "variants": measured,
        "goals": {"decode_overhead": GOAL_OVERHEAD, "moe_ratio": GOAL_MOE_RATIO},
        "seconds": time.perf_counter() - start,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(
        "\nvariant  batch adapters  base µs   LoRA µs  overhead  floor  added÷floor"
        "  step÷floor  (MoE LoRA ÷ base)"
    )
    for name, result in measured.items():
        for r in result["decode"]:
            print(
                f"{name:8s} {r['batch']:5d} {r['adapters']:8d} {r['base_us']:8.1f} "
                f"{r['lora_us']:9.1f} {r['overhead']:+8.1%} {r['floor_overhead']:+6.1%} "
                f"{r['added_over_floor']:8.2f} {r['lora_step_over_floor']:11.2f}"
            )
        print(f"{name:8s} MoE B={MOE_BATCH} ×{MOE_ADAPTERS}: {result['moe']['ratio']:.3f}")
    plot(results, out.with_suffix(".png"))


def renew_runner(setup: Setup) -> None:
    """Replace the setup's runner by a fresh one on the same model and pool (no graphs).
    Before an ablation detaches modules, never inside one: a runner attaches the whole pool."""
    runner = setup.runner
    setup.runner = ModelRunner(runner.model, runner.config, runner.lora_pool)


def smoke() -> None:
    """CPU: build the same setup at tiny sizes and run one eager step of each batch kind."""
    setup = make_setup(v2_lite_config(2, smoke=True), "cpu", 20, batches=(1, 8), graphs=False)
    for name in [*KERNEL_SETS, *ABLATIONS]:
        renew_runner(setup)  # as `run` does
        with variant(name, setup.model):
            held = {module: getattr(owner, attribute) is not None
                    for _, module, owner, attribute in lora_targets(setup.model)}  # fmt: skip
            left_out = ABLATIONS.get(name, ())  # () for a kernel set: no module starts with it
            assert all(held[m] != m.startswith(left_out) for m in held), f"{name}: {held}"
            for size in (1, 8):
                outputs = []
                for adapters in (0, min(size, setup.num_slots)):
                    input_ids, batch = decode_batch(setup, size, adapters)
                    assert (batch.lora is None) == (adapters == 0)
                    torch.manual_seed(size)  # the same tokens with and without LoRA
                    input_ids = torch.randint_like(input_ids, setup.model.config.vocab_size)
                    logits = setup.runner.execute(input_ids, batch)
                    vocab = setup.model.config.vocab_size
                    assert logits.shape == (size, vocab) and torch.isfinite(logits).all()
                    outputs.append(logits)
                # The timed LoRA steps must do LoRA work: the adapters change every row.
                changed = (outputs[0] - outputs[1]).abs().amax(dim=-1) > 1e-6  # [size]
                assert changed.all(), f"{name}: LoRA left {int((~changed).sum())} rows as base"
                base_bytes, lora_bytes = case_bytes(setup, size, min(size, setup.num_slots))
                assert base_bytes > 0 and lora_bytes > 0
            input_ids, batch = prefill_batch(setup, 4, setup.context, 2)
            logits = setup.runner.execute(input_ids, batch)
            assert logits.shape[0] == 4 and torch.isfinite(logits).all()
    assert all(getattr(owner, attr) is not None for *_, owner, attr in lora_targets(setup.model))
    print("smoke ok")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="results JSON (GPU run); the PNG goes beside it")
    parser.add_argument("--smoke", action="store_true", help="CPU: the setup at tiny sizes")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (V2-Lite: 27)")
    parser.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    parser.add_argument(
        "--variants", nargs="+", default=["new"], choices=[*KERNEL_SETS, *ABLATIONS],
        help="kernel sets (and ablations) to time side by side",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true", help="also record µs per kernel class (torch profiler)"
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        type=parse_case,
        help="decode cases BATCHxADAPTERS (default: batches 1 64 256, adapters "
        f"min(batch, {NUM_ADAPTERS}))",
    )
    parser.add_argument("--rank", type=int, default=RANK, help="the adapters' (and pool's) rank")
    parser.add_argument(
        "--no-routed",
        action="store_true",
        help="adapters on every module but the routed experts (what most MoE fine-tunes train)",
    )
    parser.add_argument(
        "--prefill",
        action="store_true",
        help=f"also a prefill step of {PREFILL_SEQS} prompts of --context tokens (eager)",
    )
    args = parser.parse_args()
    if args.smoke:
        smoke()
    elif args.out:
        run(
            args.out,
            args.layers,
            args.context,
            args.variants,
            args.profile,
            args.prefill,
            args.cases,
            args.rank,
            not args.no_routed,
        )
    else:
        parser.error("give --out or --smoke")


if __name__ == "__main__":
    main()
