"""Packed adapters: the buffer layout, staging chunks, and packed slot loads that give the
same slot contents as the per-tensor path (rank padding, shared_outer broadcast, missing
layers, reloads, tiny staging buffers that force many chunks)."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch

from adapter_store.errors import FailedPrecondition
from adapter_store.format import CanonicalAdapter, model_lora_shapes, module_key, tensor_name
from inference_svc.adapters.host_cache import HostAdapterCache, HostCacheConfig, adapter_bytes
from inference_svc.lora.packing import (
    ALIGN_ELEMENTS,
    PackedAdapter,
    PackRun,
    SlotPacking,
    staging_chunks,
)
from inference_svc.lora.pool import LoraPool, LoraPoolConfig
from tests.fixtures.random_adapters import random_adapter
from tests.fixtures.slot_checks import assert_slot_empty, assert_slot_holds, host_copy
from tests.fixtures.tiny_models import tiny_config

MAX_RANK = 16
CONFIG = tiny_config("v3_q_lora").to_dict()
SHAPES = model_lora_shapes(CONFIG)


def _pool(dtype=torch.float32, slots: int = 3, staging_bytes: int = 1 << 30, device="cpu"):
    config = LoraPoolConfig(MAX_RANK, dtype, device, max_loras=slots, staging_bytes=staging_bytes)
    return LoraPool(SHAPES, slots, config)


def _without(adapter: CanonicalAdapter, drop: set[tuple[int, str]]) -> CanonicalAdapter:
    """The adapter minus some module instances (as if PEFT had skipped those layers)."""
    keys = {module_key(layer, module) for layer, module in drop}
    manifest = adapter.manifest
    manifest = replace(
        manifest,
        module_ranks={k: v for k, v in manifest.module_ranks.items() if k not in keys},
        module_slices={k: v for k, v in manifest.module_slices.items() if k not in keys},
    )
    tensors = {name: t for name, t in adapter.tensors.items() if name.rsplit(".", 1)[0] not in keys}
    return CanonicalAdapter(manifest, tensors)


def test_packed_layout() -> None:
    adapter = random_adapter(CONFIG, 8, moe_layout="shared_outer", seed=1)
    packed = SlotPacking.for_shapes(SHAPES, torch.float32).pack(adapter)
    assert isinstance(packed, PackedAdapter) and packed.flat.is_contiguous()
    assert packed.manifest == adapter.manifest
    # One run per group and part, groups in the pool's order, lora_A before lora_B.
    groups = list(SHAPES.values())
    assert [(run.group, run.part) for run in packed.runs] == [
        (g, part) for g in range(len(groups)) for part in ("lora_A", "lora_B")
    ]
    end = 0
    for run in packed.runs:
        assert run.offset % ALIGN_ELEMENTS == 0 and end <= run.offset < end + ALIGN_ELEMENTS
        assert (run.first, run.count) == (0, len(groups[run.group].layers))
        end = run.end
    assert packed.flat.numel() == end
    assert adapter_bytes(packed) == 4 * end
    # Every tensor is a view of the buffer at its run's place, with the same values.
    base = packed.flat.data_ptr()
    for run in packed.runs:
        shape = groups[run.group]
        for index in range(run.count):
            name = tensor_name(shape.layers[run.first + index], shape.module, run.part)
            view = packed.tensors[name]
            assert view.data_ptr() == base + 4 * (run.offset + index * run.layer_numel)
            assert tuple(view.shape) == run.layer_shape
            assert torch.equal(view, adapter.tensors[name])
    assert list(packed.tensors) == list(adapter.tensors)


def test_missing_layers_split_runs_and_dtype_converts() -> None:
    adapter = _without(
        random_adapter(CONFIG, 4, seed=2), {(1, "attn.o"), (0, "attn.kv_b"), (2, "moe.down")}
    )
    packed = SlotPacking.for_shapes(SHAPES, torch.float16).pack(adapter)
    o_group = list(SHAPES).index("attn.o")
    o_runs = [(r.first, r.count) for r in packed.runs if r.group == o_group]
    assert o_runs == [(0, 1), (2, 1), (0, 1), (2, 1)]  # A: layers 0 and 2, then B
    assert packed.manifest.dtype == "float16" and packed.flat.dtype == torch.float16
    for name, tensor in adapter.tensors.items():
        assert torch.equal(packed.tensors[name], tensor.to(torch.float16))


def test_pack_refuses_a_module_the_pool_lacks() -> None:
    other = tiny_config("v3_no_q_lora").to_dict()
    with pytest.raises(FailedPrecondition, match="attn.q, which the base model lacks"):
        SlotPacking.for_shapes(SHAPES, torch.float32).pack(
            random_adapter(other, 4, modules=["attn.q"])
        )


def test_packed_adapters_that_do_not_fit_are_refused_before_any_copy() -> None:
    pool = _pool()
    wide = random_adapter(tiny_config("v3_wide").to_dict(), 4, modules=["attn.o"], seed=9)
    with pytest.raises(FailedPrecondition, match=r"layers.0.attn.o: adapter lora_A .* not fit"):
        pool.load(0, pool.packing.pack(wide))
    with pytest.raises(FailedPrecondition, match="rank 32 exceeds"):
        pool.load(0, pool.packing.pack(random_adapter(CONFIG, 32)))
    assert_slot_empty(pool, 0)


def _runs(seed: int) -> tuple[PackRun, ...]:
    rng = random.Random(seed)
    runs, end = [], 0
    for group in range(rng.randint(1, 6)):
        layer_shape = (rng.randint(1, 4), rng.randint(1, 40))
        start = end + rng.randint(0, 5)
        run = PackRun(group, "lora_A", rng.randint(0, 3), rng.randint(1, 7), layer_shape, start)
        runs.append(run)
        end = run.end
    return tuple(runs)


def _layers(runs) -> list[tuple[int, int, int]]:
    """(group, layer position, buffer offset) of every layer of `runs`, in order."""
    return [
        (run.group, run.first + i, run.offset + i * run.layer_numel)
        for run in runs
        for i in range(run.count)
    ]


@pytest.mark.parametrize("seed", range(25))
def test_staging_chunks_cover_every_layer_once_within_capacity(seed: int) -> None:
    runs = _runs(seed)
    capacity = random.Random(seed).randint(max(r.layer_numel for r in runs), 600)
    chunks = staging_chunks(runs, capacity)
    for chunk in chunks:
        assert chunk and chunk[-1].end - chunk[0].offset <= capacity
    pieces = list(itertools.chain.from_iterable(chunks))
    layers = [
        (p.group, p.first + i, p.offset + i * p.layer_numel) for p in pieces for i in range(p.count)
    ]
    want = [
        (r.group, r.first + i, r.offset + i * r.layer_numel) for r in runs for i in range(r.count)
    ]
    assert layers == want
    # A chunk is closed only when the next layer did not fit.
    for chunk, following in itertools.pairwise(chunks):
        assert following[0].offset + following[0].layer_numel - chunk[0].offset > capacity


def test_staging_too_small_for_one_layer() -> None:
    with pytest.raises(ValueError, match="holds no layer of 40"):
        staging_chunks((PackRun(0, "lora_B", 0, 2, (4, 10), 0),), 39)


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
@pytest.mark.parametrize("rank", [1, 8, MAX_RANK])
@pytest.mark.parametrize("staging_bytes", [1 << 30, 1])  # one chunk / one layer a chunk
def test_packed_load_equals_the_canonical_tensors(layout, rank, staging_bytes) -> None:
    pool = _pool(staging_bytes=staging_bytes)
    adapter = random_adapter(CONFIG, rank, moe_layout=layout, seed=rank)
    packed = pool.packing.pack(adapter)
    if staging_bytes == 1 and rank > 1:  # halves of one layer at MAX_RANK: many chunks
        assert len(staging_chunks(packed.runs, pool.staging_half)) > 2
    load = pool.load(1, packed)
    assert load.done()
    assert_slot_holds(pool, 1, adapter)
    assert pool.slot_rank.tolist() == [0, rank, 0] and pool.slot_rank_host == [0, rank, 0]
    assert_slot_empty(pool, 0)
    assert_slot_empty(pool, 2)


def test_loads_of_one_layout_reuse_their_plan_and_views() -> None:
    """The load plan and the chunks' views are cached per layout, slot and staging half:
    adapters of one layout loaded in turn into the same and other slots (both halves, many
    chunks) each land whole, and a second round reuses the cached views."""
    pool = _pool(staging_bytes=1)
    adapters = [random_adapter(CONFIG, 8, seed=seed) for seed in (11, 12, 13)]
    for round_ in range(2):
        for slot, adapter in [
            (1, adapters[0]),
            (1, adapters[1]),
            (2, adapters[2]),
            (0, adapters[1]),
        ]:
            pool.load(slot, pool.packing.pack(adapter))
            assert_slot_holds(pool, slot, adapter)
        cached = len(pool._copy_views)
        if round_ == 0:
            first_round = cached
    assert cached == first_round > 0  # the second round made no new views


def test_packed_reload_zeroes_what_the_new_adapter_leaves() -> None:
    pool = _pool()
    pool.load(0, pool.packing.pack(random_adapter(CONFIG, MAX_RANK, seed=3)))
    partial = _without(
        random_adapter(CONFIG, 4, modules=["attn.q_b", "attn.o", "moe.down"], seed=4),
        {(1, "attn.o"), (2, "moe.down")},
    )
    pool.load(0, pool.packing.pack(partial))
    assert_slot_holds(pool, 0, partial)
    assert pool.unload(0).done()
    assert_slot_empty(pool, 0)


def test_adapter_packed_for_another_pool_takes_the_tensor_path() -> None:
    pool = _pool(dtype=torch.bfloat16)
    adapter = random_adapter(CONFIG, 8, moe_layout="shared_outer", seed=5)
    packed_fp32 = SlotPacking.for_shapes(SHAPES, torch.float32).pack(adapter)
    pool.load(2, packed_fp32)
    assert_slot_holds(pool, 2, adapter)


def test_host_cache_packs_for_the_pool() -> None:
    pool = _pool(dtype=torch.bfloat16)
    cache = HostAdapterCache(HostCacheConfig(1 << 26, dtype=torch.bfloat16), pool.packing)
    adapter = random_adapter(CONFIG, 8, seed=6)
    stored = cache.insert("a", adapter)
    assert isinstance(stored, PackedAdapter) and stored.packing == pool.packing
    assert cache.metrics().bytes_used == adapter_bytes(stored) == 2 * stored.flat.numel()
    pool.load(0, stored)
    cache.release("a")
    assert_slot_holds(pool, 0, adapter)
    with pytest.raises(ValueError, match="differs from the pool packing"):
        HostAdapterCache(HostCacheConfig(1 << 20, dtype=torch.float16), pool.packing)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("staging_bytes", [1 << 30, 4096])
def test_cuda_packed_loads_back_to_back(staging_bytes: int) -> None:
    """Loads queued without waiting, through both staging halves (many chunks with a tiny
    staging buffer), each slot then equal to the CPU pool's result; a load whose event is
    waited on is visible to the current stream."""
    pool = _pool(torch.bfloat16, slots=4, staging_bytes=staging_bytes, device="cuda")
    adapters = [
        random_adapter(CONFIG, rank, moe_layout=layout, dtype=torch.bfloat16, seed=seed)
        for seed, (rank, layout) in enumerate(
            [(16, "per_expert"), (8, "shared_outer"), (3, "per_expert"), (16, "shared_outer")]
        )
    ]
    packed = [pool.packing.pack(adapter, pin=True) for adapter in adapters]
    assert all(p.flat.is_pinned() for p in packed)
    pool.load(0, packed[2])  # overwritten below: the reload must zero its leftovers
    loads = [pool.load(slot, adapter) for slot, adapter in enumerate(packed)]
    assert all(load.event is not None for load in loads)
    for load in loads:
        load.wait_on()
    host = host_copy(pool)  # copies on the current stream
    assert all(load.done() for load in loads)
    for slot, adapter in enumerate(adapters):
        assert_slot_holds(host, slot, adapter)
    assert pool.slot_rank.tolist() == [16, 8, 3, 16]
