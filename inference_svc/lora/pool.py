"""The GPU LoRA slot pool: fixed device buffers that hold `num_slots` adapters at once.

Per canonical module and decoder layer (legend: S slots, R max rank, E routed experts,
`stack` = number of stacked slices of the module):

    lora_a(layer, module)   [S, stack*R, in]        MoE: [S, E, stack*R, in]
    lora_b(layer, module)   [S, out_total, R]       MoE: [S, E, out_total, R]
    slot_rank               int32 [S]               the loaded adapter's rank, 0 = empty
    module_rank             int32 [instances, S]    per module instance: the rank, 0 where
                                                    the slot's adapter does not target it

Slice `s` of A owns rows `s*R : s*R + r`; B owns columns `:r` (r = the adapter's rank). The
rows/columns from r to R are zero, and so is every module an adapter does not target, so a
rank-8 adapter in a rank-64 pool gives exact results and kernels may read only `slot_rank`
rank rows. The model's modules read their own row of `module_rank`, so the kernels skip the
tokens of an adapter that does not target the module (an attention-only adapter reads no
routed-expert LoRA weights) instead of multiplying its zeros.

MoE "shared_outer" adapters store one `lora_A` of `moe.gate_up` and one `lora_B` of
`moe.down` (leading dim 1). The pool has one layout for all adapters: the shared part is
copied to expert 0 once over PCIe and broadcast to the other experts on the device, so the
MoE kernels index `[slot, expert]` without a per-slot layout flag. The pool needs the
per-expert memory anyway (a per-expert adapter can land in any slot).

Layers with the same module shape share one allocation `[layers, S, ...]`; `lora_a` /
`lora_b` return per-layer views, which are contiguous. `carry_base_weights` moves dense
modules' base weights into their A allocation, each layer's [N, in] right above its
[S·stack·R, in] A rows (`carrier`): one product with the carrier is the base output and
every slot's shrink (`inference_svc.lora.apply.shrinks_in_product`).

Loads run on a side CUDA stream that first waits for the work already queued on the
current stream (a forward may still read the evicted adapter) and record an event the
scheduler waits on before running a batch that uses the slot. On the CPU the copies are
plain and the event is None.

Two load paths, same result:
- a `PackedAdapter` packed for this pool (what the host cache holds when built with
  `pool.packing`): its one pinned buffer crosses the link in chunks of up to half the
  staging buffer, on a copy stream, into the two staging halves in turn; the side stream
  scatters each chunk with one copy per run (≈ one per group and part), broadcasting a
  shared_outer side over the experts, while the next chunk crosses. The rank padding is
  zeroed by one op per group and part (all of the slot's group where the adapter misses
  layers). DeepSeek-V2-Lite rank 16: ~40 device ops instead of ~500 host→device copies.
- any other `CanonicalAdapter`: one non-blocking copy per layer × module × slice from
  its (pinned) tensors, after zeroing the whole slot.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from adapter_store.errors import FailedPrecondition
from adapter_store.format import (
    CanonicalAdapter,
    LoraPart,
    Manifest,
    ModuleShape,
    module_key,
    tensor_name,
)
from adapter_store.model_shapes import is_routed_expert_module
from inference_svc.lora.packing import PackedAdapter, PackRun, SlotPacking, staging_chunks

log = logging.getLogger(__name__)

GIB = 1 << 30
MIB = 1 << 20
# Chunk views `_chunk_copies` keeps (slots × 2 staging halves × chunks per layout × ranks:
# ~1200 for 64 slots of one V2-Lite layout); past this the cache starts over.
MAX_CACHED_COPY_VIEWS = 8192


def check_lora_budget(memory_gb: float | None, memory_fraction: float | None) -> None:
    """Raise unless the pool's memory budget is at most one of: GiB > 0, a fraction in (0, 1]."""
    if memory_gb is not None and memory_fraction is not None:
        raise ValueError("give lora_memory_gb or lora_memory_fraction, not both")
    if memory_gb is not None and memory_gb <= 0:
        raise ValueError(f"lora_memory_gb must be > 0, got {memory_gb}")
    if memory_fraction is not None and not 0 < memory_fraction <= 1:
        raise ValueError(f"lora_memory_fraction must be in (0, 1], got {memory_fraction}")


@dataclass(frozen=True)
class LoraPoolConfig:
    """How big the pool is: `max_loras` slots, or as many as a memory budget holds, or both
    (then the smaller). The budget is `lora_memory_gb` or `lora_memory_fraction` of the
    device's free memory."""

    max_lora_rank: int
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"
    max_loras: int | None = None
    lora_memory_gb: float | None = None
    lora_memory_fraction: float | None = None
    # Device buffer that packed adapters cross the link into, in two halves (one fills
    # while the other is scattered). Capped at what one slot's adapter can need.
    staging_bytes: int = 128 * MIB

    def __post_init__(self) -> None:
        if self.staging_bytes < 1:
            raise ValueError(f"staging_bytes must be >= 1, got {self.staging_bytes}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        check_lora_budget(self.lora_memory_gb, self.lora_memory_fraction)
        if self.max_loras is None and self.budget_source is None:
            raise ValueError("give max_loras, lora_memory_gb or lora_memory_fraction")
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point type, got {self.dtype}")

    @property
    def budget_source(self) -> str | None:
        if self.lora_memory_gb is not None:
            return "lora_memory_gb"
        if self.lora_memory_fraction is not None:
            return "lora_memory_fraction"
        return None


def buffer_shapes(
    shape: ModuleShape, num_slots: int, max_rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one layer's A and B buffers of `shape` for `num_slots` slots."""
    experts = () if shape.num_experts is None else (shape.num_experts,)
    a_shape = (num_slots, *experts, shape.stack * max_rank, shape.in_features)
    b_shape = (num_slots, *experts, shape.out_features, max_rank)
    return a_shape, b_shape


def slot_bytes(shapes: Mapping[str, ModuleShape], max_rank: int, dtype: torch.dtype) -> int:
    """Device bytes one slot of rank `max_rank` takes over every module and layer."""
    elements = 0
    for shape in shapes.values():
        a_shape, b_shape = buffer_shapes(shape, 1, max_rank)
        elements += len(shape.layers) * (math.prod(a_shape) + math.prod(b_shape))
    return elements * dtype.itemsize


def staging_elements(
    shapes: Mapping[str, ModuleShape], max_rank: int, dtype: torch.dtype, staging_bytes: int
) -> int:
    """Elements of each of the two staging halves: together `staging_bytes`, or one slot's
    bytes if less, but each at least one layer's lora_A or lora_B at `max_rank`."""
    per_slot = slot_bytes(shapes, max_rank, dtype)
    largest_layer = max(
        math.prod(part) for shape in shapes.values() for part in buffer_shapes(shape, 1, max_rank)
    )
    return max(largest_layer, min(staging_bytes, per_slot) // 2 // dtype.itemsize)


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of `device`: the CUDA allocator's view, or the host's available RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_num_slots(config: LoraPoolConfig, shapes: Mapping[str, ModuleShape]) -> int:
    """How many slots the pool gets; logs the sizing decision. Raises ValueError when the
    budget holds not even one slot."""
    per_slot = slot_bytes(shapes, config.max_lora_rank, config.dtype)
    staging = (
        2
        * config.dtype.itemsize
        * staging_elements(shapes, config.max_lora_rank, config.dtype, config.staging_bytes)
    )
    source = config.budget_source
    if source is None:
        assert config.max_loras is not None  # __post_init__ guarantees one of the two
        slots, budget_text = config.max_loras, "max_loras"
    else:
        if config.lora_memory_gb is not None:
            budget = int(config.lora_memory_gb * GIB)
            budget_text = f"lora_memory_gb={config.lora_memory_gb:g}"
        else:
            fraction = config.lora_memory_fraction or 0.0
            free = free_memory_bytes(torch.device(config.device))
            budget = int(fraction * free)
            budget_text = f"lora_memory_fraction={fraction:g} of {free / GIB:.2f} GiB free"
        slots = max(0, budget - staging) // per_slot
        if slots < 1:
            raise ValueError(
                f"LoRA pool: {budget / GIB:.3f} GiB ({budget_text}) holds no slot of rank "
                f"{config.max_lora_rank}; one slot needs {per_slot / MIB:.1f} MiB besides "
                f"{staging / MIB:.1f} MiB of staging"
            )
        if config.max_loras is not None:
            slots = min(slots, config.max_loras)
    log.info(
        "LoRA pool: %d slots of rank %d (%s, %.1f MiB per slot + %.1f MiB staging, "
        "%.3f GiB in all; %s)",
        slots,
        config.max_lora_rank,
        str(config.dtype).removeprefix("torch."),
        per_slot / MIB,
        staging / MIB,
        (slots * per_slot + staging) / GIB,
        budget_text,
    )
    return slots


class CarriedModule(Protocol):
    """A dense module whose base weight the pool can carry (`LoraPool.carry_base_weights`)."""

    @property
    def weight(self) -> Tensor: ...

    def keep_weight_in(self, carrier: Tensor) -> None:
        """Read the weight from carrier[:N] from now on (its values are already there)."""


@dataclass(frozen=True)
class SlotLoad:
    """A copy into a slot in flight: wait for `event` before reading the slot on a stream."""

    slot: int
    event: torch.cuda.Event | None  # None on the CPU, where the copy has completed

    def done(self) -> bool:
        """Whether the copy has completed (never blocks)."""
        return self.event is None or self.event.query()

    def wait_on(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for the copy, without a host sync."""
        if self.event is not None:
            self.event.wait(stream)


class LoraPool:
    """Device buffers of every canonical module and layer for `num_slots` adapters."""

    def __init__(
        self, shapes: Mapping[str, ModuleShape], num_slots: int, config: LoraPoolConfig
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.config = config
        self.num_slots = num_slots
        self.max_rank = config.max_lora_rank
        self.device = torch.device(config.device)
        self.dtype = config.dtype
        self.shapes = dict(shapes)
        self.bytes_per_slot = slot_bytes(shapes, self.max_rank, self.dtype)
        self._a: dict[tuple[int, str], Tensor] = {}
        self._b: dict[tuple[int, str], Tensor] = {}
        self._shape_of: dict[tuple[int, str], ModuleShape] = {}
        # One [layers, S, ...] allocation per module shape: zeroing a slot is 2 ops per
        # shape instead of 2 per layer and module (~1000 launches on DeepSeek-V3), and a
        # packed load scatters all layers of a shape with one op.
        self._groups: list[tuple[Tensor, Tensor]] = []  # order of `shapes` = packing.groups
        for shape in shapes.values():
            a_shape, b_shape = buffer_shapes(shape, num_slots, self.max_rank)
            a_all = self._zeros((len(shape.layers), *a_shape))
            b_all = self._zeros((len(shape.layers), *b_shape))
            self._groups.append((a_all, b_all))
            for index, layer in enumerate(shape.layers):
                self._a[layer, shape.module] = a_all[index]
                self._b[layer, shape.module] = b_all[index]
                self._shape_of[layer, shape.module] = shape
        self.slot_rank = torch.zeros(num_slots, dtype=torch.int32, device=self.device)
        self._instance_row = {key: row for row, key in enumerate(self._a)}
        self.module_rank = torch.zeros(
            (len(self._instance_row), num_slots), dtype=torch.int32, device=self.device
        )
        # Host mirror of slot_rank, for building batch metadata without a device read.
        self.slot_rank_host = [0] * num_slots
        # Host: whether each slot's adapter targets the routed experts. A step none of whose
        # adapters does runs its MoE layers without LoRA (`LoraBatch.routed_experts`).
        self.slot_routed_host = [False] * num_slots
        self.packing = SlotPacking.for_shapes(shapes, self.dtype)
        self.staging_half = staging_elements(
            shapes, self.max_rank, self.dtype, config.staging_bytes
        )
        self._staging = self._zeros((2, self.staging_half)).unbind(0)  # 2 × [staging_half]
        self._next_half = 0
        on_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if on_cuda else None
        # Host→device copies into staging go on a stream of their own so that a chunk
        # crosses the link while the side stream scatters the one before it.
        self._copy_stream = torch.cuda.Stream(self.device) if on_cuda else None
        # Per staging half, recorded on the side stream after the scatter that read it.
        self._half_free: list[torch.cuda.Event | None] = [None, None]
        self._copy_views: dict[tuple, list[tuple[Tensor, Tensor]]] = {}
        self._group_layers = tuple(a_all.shape[0] for a_all, _ in self._groups)
        # (layer, module) -> [N + S·stack·R, in]: the base weight above the A buffer.
        self._carriers: dict[tuple[int, str], Tensor] = {}

    @classmethod
    def from_config(cls, shapes: Mapping[str, ModuleShape], config: LoraPoolConfig) -> LoraPool:
        """A pool sized by `plan_num_slots` (logs how many slots of which rank fit)."""
        return cls(shapes, plan_num_slots(config, shapes), config)

    def lora_a(self, layer: int, module: str) -> Tensor:
        """A buffer of one module instance: [S, stack*R, in] (MoE [S, E, stack*R, in])."""
        return self._a[layer, module]

    def lora_b(self, layer: int, module: str) -> Tensor:
        """B buffer of one module instance: [S, out_total, R] (MoE [S, E, out_total, R])."""
        return self._b[layer, module]

    def carrier(self, layer: int, module: str) -> Tensor | None:
        """[N + S·stack·R, in]: the module instance's base weight (rows :N) above its A
        buffer viewed flat, where `carry_base_weights` moved the weight here; else None."""
        return self._carriers.get((layer, module))

    def carry_base_weights(self, modules: Mapping[tuple[int, str], CarriedModule]) -> None:
        """Move the base weights [N, in] of dense (non-expert) module instances into the
        pool: each group of one module shape whose every layer is in `modules` (weights in
        the pool's dtype) gets one allocation [layers, N + S·stack·R, in] holding each
        layer's weight above its A buffer, which it replaces (contents copied); each module
        then reads its weight from `carrier(layer, module)[:N]` (`keep_weight_in`), so the
        old weights are freed group by group (the extra memory is one group's weights while
        it moves). A group already carried is left as it is; it raises ValueError unless
        the modules' weights are its carriers' own rows (another model's)."""
        current = torch.cuda.current_stream(self.device) if self._stream is not None else None
        if current is not None:  # a load in flight writes the A buffers this copies
            current.wait_stream(self._stream)
        for group, shape in enumerate(self.shapes.values()):
            keys = [(layer, shape.module) for layer in shape.layers]
            if shape.num_experts is not None or any(key not in modules for key in keys):
                continue
            n = shape.out_features
            if keys[0] in self._carriers:
                held = self._carriers
                if any(modules[key].weight.data_ptr() != held[key].data_ptr() for key in keys):
                    raise ValueError(f"{shape.module}: the pool carries another model's weights")
                continue
            for key in keys:
                w = modules[key].weight
                if w.shape != (n, shape.in_features) or w.dtype != self.dtype:
                    raise ValueError(
                        f"{module_key(*key)}: weight {tuple(w.shape)} {w.dtype} does not fit "
                        f"[{n}, {shape.in_features}] {self.dtype}"
                    )
            a_all, b_all = self._groups[group]  # [L, S, stack·R, in]
            carriers = torch.empty(
                (len(keys), n + a_all.shape[1] * a_all.shape[2], shape.in_features),
                dtype=self.dtype, device=self.device,
            )  # fmt: skip
            carriers[:, n:].copy_(a_all.flatten(1, 2))
            a_all = carriers[:, n:].unflatten(1, a_all.shape[1:3])  # each layer's contiguous
            self._groups[group] = (a_all, b_all)
            for index, key in enumerate(keys):
                carriers[index, :n].copy_(modules[key].weight)
                modules[key].keep_weight_in(carriers[index])
                self._a[key] = a_all[index]
                self._carriers[key] = carriers[index]
        self._copy_views.clear()  # views of the replaced A buffers
        if current is not None:  # later loads write the new A buffers after these copies
            self._stream.wait_stream(current)

    def rank_of(self, layer: int, module: str) -> Tensor:
        """int32 [S] rank of each slot's adapter in one module instance (0: not targeted);
        a view, so loads show through."""
        return self.module_rank[self._instance_row[layer, module]]

    def module_instances(self) -> list[tuple[int, str]]:
        """(layer, module) of every module instance the pool holds."""
        return list(self._a)

    @property
    def holds_routed_experts(self) -> bool:
        """Whether the pool has routed-expert modules (an MoE base model)."""
        return any(is_routed_expert_module(module) for _, module in self._a)

    def check_compatible(self, adapter: CanonicalAdapter) -> None:
        """Raise FailedPrecondition when the adapter cannot go into this pool (rank above
        the pool's, a module or shape the base model does not have)."""
        manifest = adapter.manifest
        if manifest.rank > self.max_rank:
            raise FailedPrecondition(
                f"adapter rank {manifest.rank} exceeds this server's max_lora_rank {self.max_rank}"
            )
        r = manifest.rank
        if isinstance(adapter, PackedAdapter) and adapter.packing == self.packing:
            # Packing placed every module in a group of this pool; check the ~20 runs'
            # shapes instead of ~250 tensors (about 1 ms of host time on V2-Lite).
            for run in adapter.runs:
                shape = self.packing.groups[run.group]
                if not _part_fits(shape, run.part, run.layer_shape, r):
                    layer = shape.layers[run.first]
                    raise FailedPrecondition(
                        f"{module_key(layer, shape.module)}: adapter {run.part} "
                        f"{list(run.layer_shape)} does not fit the base model (in "
                        f"{shape.in_features}, out slices {list(shape.out_slices)}, experts "
                        f"{shape.num_experts})"
                    )
            return
        for layer, module in manifest.modules:
            shape = self._shape_of.get((layer, module))
            key = module_key(layer, module)
            if shape is None:
                raise FailedPrecondition(f"adapter has {key}, which the base model lacks")
            lora_a = adapter.tensors[tensor_name(layer, module, "lora_A")]
            lora_b = adapter.tensors[tensor_name(layer, module, "lora_B")]
            if not (
                _part_fits(shape, "lora_A", lora_a.shape, r)
                and _part_fits(shape, "lora_B", lora_b.shape, r)
            ):
                raise FailedPrecondition(
                    f"{key}: adapter lora_A {list(lora_a.shape)} / lora_B "
                    f"{list(lora_b.shape)} do not fit the base model (in {shape.in_features}, "
                    f"out slices {list(shape.out_slices)}, experts {shape.num_experts})"
                )

    def load(self, slot: int, adapter: CanonicalAdapter) -> SlotLoad:
        """Copy `adapter` into `slot`, zeroing whatever it does not fill.

        Semantics: A[slot] = 0; B[slot] = 0; then per module, slice s:
            A[slot, .., s*R : s*R+r, :] = lora_A[.., s*r : (s+1)*r, :]
            B[slot, .., :, :r] = lora_B;  slot_rank[slot] = r
        with a leading dim of 1 (shared_outer) broadcast over the experts.
        Host tensors must stay alive (and unchanged) until the returned load is done.
        A `PackedAdapter` packed with `self.packing` takes the fast path (module docstring).
        """
        self._check_slot(slot)
        self.check_compatible(adapter)
        r = adapter.manifest.rank
        with self._on_side_stream():
            if isinstance(adapter, PackedAdapter) and adapter.packing == self.packing:
                self._load_packed(slot, adapter)
            else:
                self._load_tensors(slot, adapter)
            # No host→device copy that blocks: `slot_rank[slot] = r` (a 0-dim target is
            # filled by a synchronous copy) and a copy into the strided rank column both
            # made the host wait until the side stream had run everything queued before
            # them, i.e. the whole adapter's copies: the engine thread stalled for each
            # slot load (H100: the call took as long as the GPU work ahead of it). A fill
            # kernel, and a pinned non-blocking upload then a device-side copy, do not.
            self.slot_rank[slot : slot + 1].fill_(r)
            ranks = self._module_ranks(adapter.manifest).to(self.device, non_blocking=True)
            self.module_rank[:, slot].copy_(ranks)
            event = self._record()
        self.slot_rank_host[slot] = r
        self.slot_routed_host[slot] = adapter.manifest.targets_routed_experts
        return SlotLoad(slot, event)

    def _module_ranks(self, manifest: Manifest) -> Tensor:
        """int32 [instances]: each targeted module instance's true rank (≤ the adapter's:
        a rank_pattern module's columns past its own rank are zero), 0 elsewhere."""
        ranks = [0] * len(self._instance_row)
        for key, rank in zip(manifest.modules, manifest.module_ranks.values(), strict=True):
            ranks[self._instance_row[key]] = rank
        return torch.tensor(ranks, dtype=torch.int32, pin_memory=self._stream is not None)

    def _load_packed(self, slot: int, adapter: PackedAdapter) -> None:
        """On the side stream: zero what the runs leave, then stage and scatter the chunks."""
        r = adapter.manifest.rank
        plan = _load_plan(adapter.runs, self.staging_half, self._group_layers)
        for group, (a_all, b_all) in enumerate(self._groups):
            if group in plan.whole_groups:
                if r < self.max_rank:  # the runs write rank rows/columns :r only
                    _a_rank_rows(a_all[:, slot], self.max_rank)[..., r:, :].zero_()
                    b_all[:, slot, ..., r:].zero_()
            else:
                a_all[:, slot].zero_()
                b_all[:, slot].zero_()
        for pieces in plan.chunks:
            half = self._stage(adapter.flat[pieces[0].offset : pieces[-1].end])
            for dst, src in self._chunk_copies(slot, half, pieces, r):
                dst.copy_(src)
            if self._stream is not None:
                self._half_free[half] = self._stream.record_event()

    def _stage(self, host: Tensor) -> int:
        """Copy `host` into the next staging half (after the side stream's last read of
        it); the side stream waits for the copy. Returns the half."""
        half = self._next_half
        self._next_half ^= 1
        staged = self._staging[half][: host.numel()]
        if self._copy_stream is None or self._stream is None:
            staged.copy_(host)
            return half
        free = self._half_free[half]
        if free is not None:
            self._copy_stream.wait_event(free)
        with torch.cuda.stream(self._copy_stream):
            staged.copy_(host, non_blocking=True)
        self._stream.wait_stream(self._copy_stream)
        return half

    def _chunk_copies(
        self, slot: int, half: int, pieces: tuple[PackRun, ...], r: int
    ) -> list[tuple[Tensor, Tensor]]:
        """(slot destination, staging source) views of one staged chunk's runs: rows :r of
        each A slice, columns :r of B; a leading expert dim of 1 is broadcast over the
        experts by copy_. Cached: making the views cost more host time than launching the
        copies (H100 serving: ~1.4 ms per 582 MB adapter, with the engine thread waiting)."""
        key = (slot, half, pieces, r)
        copies = self._copy_views.get(key)
        if copies is not None:
            return copies
        staged = self._staging[half]
        start = pieces[0].offset  # staged from the chunk's first run
        copies = []
        for piece in pieces:
            a_all, b_all = self._groups[piece.group]
            layers = slice(piece.first, piece.first + piece.count)
            source = staged[piece.offset - start : piece.end - start]
            source = source.view(piece.count, *piece.layer_shape)
            if piece.part == "lora_A":
                dst = _a_rank_rows(a_all[layers, slot], self.max_rank)[..., :r, :]
                copies.append((dst, source.unflatten(-2, (-1, r))))  # [L, (E,) stack, r, in]
            else:
                copies.append((b_all[layers, slot, ..., :r], source))  # [L, (E,) out, r]
        if len(self._copy_views) >= MAX_CACHED_COPY_VIEWS:
            self._copy_views.clear()
        self._copy_views[key] = copies
        return copies

    def _load_tensors(self, slot: int, adapter: CanonicalAdapter) -> None:
        """On the side stream: zero the slot, then one copy per layer × module × slice."""
        r = adapter.manifest.rank
        targeted = set(adapter.manifest.modules)
        self._zero_slot(slot)
        for layer_module, shape in self._shape_of.items():
            if layer_module not in targeted:
                continue
            a_slot, b_slot = self._a[layer_module][slot], self._b[layer_module][slot]
            layer, module = layer_module
            copy = _copy if shape.num_experts is None else _copy_experts
            lora_a = adapter.tensors[tensor_name(layer, module, "lora_A")]
            lora_b = adapter.tensors[tensor_name(layer, module, "lora_B")]
            for s in range(shape.stack):
                a_rows = a_slot[..., s * self.max_rank : s * self.max_rank + r, :]
                copy(a_rows, lora_a[..., s * r : (s + 1) * r, :])
            copy(b_slot[..., :r], lora_b)

    def unload(self, slot: int) -> SlotLoad:
        """Zero `slot` (all modules, rank 0), after the work queued so far."""
        self._check_slot(slot)
        with self._on_side_stream():
            self._zero_slot(slot)
            self.slot_rank[slot : slot + 1].fill_(0)  # not `[slot] = 0`: see `load`
            self.module_rank[:, slot] = 0
            event = self._record()
        self.slot_rank_host[slot] = 0
        self.slot_routed_host[slot] = False
        return SlotLoad(slot, event)

    def _zero_slot(self, slot: int) -> None:
        for a_all, b_all in self._groups:
            a_all[:, slot].zero_()
            b_all[:, slot].zero_()

    def _zeros(self, shape: tuple[int, ...]) -> Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} not in 0..{self.num_slots - 1}")

    def _on_side_stream(self):
        if self._stream is None:
            return contextlib.nullcontext()
        # Wait for queued forwards: they may still read the adapter this load replaces.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._stream)

    def _record(self) -> torch.cuda.Event | None:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event


@dataclass(frozen=True)
class _LoadPlan:
    """How a packed layout (its runs) is staged: the runs cut to each staging chunk (the
    chunk spans the buffer from its first run's offset to its last run's end), and the
    groups whose every layer the runs fill (A and B)."""

    chunks: tuple[tuple[PackRun, ...], ...]
    whole_groups: frozenset[int]


@functools.lru_cache(maxsize=64)
def _load_plan(
    runs: tuple[PackRun, ...], capacity: int, group_layers: tuple[int, ...]
) -> _LoadPlan:
    """The `_LoadPlan` of `runs` for staging halves of `capacity` elements and groups of
    `group_layers` layers. Cached: every adapter of one layout (rank, modules) has the
    same runs, and planning them cost ~0.9 ms of host time per load."""
    covered: dict[tuple[int, str], int] = {}  # (group, part) -> layers in runs
    for run in runs:
        covered[run.group, run.part] = covered.get((run.group, run.part), 0) + run.count
    whole = frozenset(
        group
        for group, layers in enumerate(group_layers)
        if covered.get((group, "lora_A")) == covered.get((group, "lora_B")) == layers
    )
    return _LoadPlan(tuple(map(tuple, staging_chunks(runs, capacity))), whole)


def _part_fits(shape: ModuleShape, part: LoraPart, tensor_shape: Sequence[int], r: int) -> bool:
    """Whether one layer's lora_A [.., stack*r, in] or lora_B [.., out, r] fits `shape`."""
    # Expert modules: per-expert [E, ..] or the shared side of shared_outer [1, ..].
    leading = {()} if shape.num_experts is None else {(1,), (shape.num_experts,)}
    tail = (shape.stack * r, shape.in_features) if part == "lora_A" else (shape.out_features, r)
    return tuple(tensor_shape[:-2]) in leading and tuple(tensor_shape[-2:]) == tail


def _a_rank_rows(a: Tensor, max_rank: int) -> Tensor:
    """[.., stack*R, in] -> [.., stack, R, in] (a view): index rank rows per slice."""
    return a.unflatten(-2, (-1, max_rank))


def _copy(dst: Tensor, src: Tensor) -> None:
    dst.copy_(src, non_blocking=True)


def _copy_experts(dst: Tensor, src: Tensor) -> None:
    """dst [E, ..] <- src [E or 1, ..], non-blocking; a shared part (leading 1) crosses the
    host→device link once and is broadcast over the experts on the device."""
    if src.shape[0] == 1 and dst.shape[0] > 1:
        dst[:1].copy_(src, non_blocking=True)
        dst[1:].copy_(dst[:1].expand_as(dst[1:]))
        return
    dst.copy_(src, non_blocking=True)
