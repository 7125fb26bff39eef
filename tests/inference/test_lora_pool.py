"""LoRA slot pool: padded loads, broadcast of shared-outer parts, unload, sizing."""

from __future__ import annotations

import logging

import pytest
import torch

from adapter_store.errors import FailedPrecondition
from adapter_store.format import model_lora_shapes
from inference_svc.lora import pool as pool_module
from inference_svc.lora.pool import (
    LoraPool,
    LoraPoolConfig,
    plan_num_slots,
    slot_bytes,
    staging_elements,
)
from tests.fixtures.random_adapters import random_adapter
from tests.fixtures.slot_checks import assert_slot_empty, assert_slot_holds, host_copy
from tests.fixtures.tiny_models import tiny_config

MAX_RANK = 16


def _config(name: str = "v3_q_lora") -> dict:
    return tiny_config(name).to_dict()


def _pool(name: str = "v3_q_lora", slots: int = 3, dtype=torch.float32) -> LoraPool:
    config = LoraPoolConfig(max_lora_rank=MAX_RANK, dtype=dtype, device="cpu", max_loras=slots)
    return LoraPool.from_config(model_lora_shapes(_config(name)), config)


def test_buffer_shapes_and_zero_init() -> None:
    pool = _pool()
    assert pool.lora_a(0, "attn.qkv_a").shape == (3, 2 * MAX_RANK, 64)
    assert pool.lora_b(0, "attn.qkv_a").shape == (3, 48 + 32 + 8, MAX_RANK)
    assert pool.lora_a(0, "mlp.gate_up").shape == (3, 2 * MAX_RANK, 64)
    assert pool.lora_b(0, "mlp.gate_up").shape == (3, 2 * 96, MAX_RANK)  # dense layer
    assert pool.lora_b(1, "mlp.gate_up").shape == (3, 2 * 32, MAX_RANK)  # shared expert
    assert pool.lora_a(2, "moe.gate_up").shape == (3, 8, 2 * MAX_RANK, 64)
    assert pool.lora_b(2, "moe.down").shape == (3, 8, 64, MAX_RANK)
    assert pool.lora_a(1, "attn.kv_b").is_contiguous()
    assert pool.slot_rank.dtype == torch.int32 and pool.slot_rank.shape == (3,)
    for slot in range(3):
        assert_slot_empty(pool, slot)


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
@pytest.mark.parametrize("rank", [8, 1, MAX_RANK])
def test_adapter_below_pool_rank_is_zero_padded(layout: str, rank: int) -> None:
    pool = _pool()
    adapter = random_adapter(_config(), rank, moe_layout=layout, seed=1)
    load = pool.load(1, adapter)
    assert load.event is None and load.done()
    assert_slot_holds(pool, 1, adapter)
    assert pool.slot_rank.tolist() == [0, rank, 0] and pool.slot_rank_host == [0, rank, 0]
    assert_slot_empty(pool, 0)
    assert_slot_empty(pool, 2)


def test_reload_zeroes_what_the_new_adapter_does_not_fill() -> None:
    pool = _pool()
    pool.load(0, random_adapter(_config(), MAX_RANK, seed=2))
    small = random_adapter(_config(), 4, modules=["attn.q_b", "moe.down"], seed=3)
    pool.load(0, small)
    assert_slot_holds(pool, 0, small)
    assert pool.slot_rank_host[0] == 4


def test_the_host_knows_which_slots_target_the_routed_experts() -> None:
    """`slot_routed_host`, which the batch builder reads: set by a load from the manifest's
    modules, cleared by a load without routed-expert modules and by unload."""
    pool = _pool()
    assert pool.holds_routed_experts
    pool.load(0, random_adapter(_config(), 8, seed=6))
    pool.load(1, random_adapter(_config(), 8, modules=["attn.q_b", "mlp.down"], seed=7))
    pool.load(2, random_adapter(_config(), 8, modules=["moe.down"], seed=8))
    assert pool.slot_routed_host == [True, False, True]
    pool.load(2, random_adapter(_config(), 8, modules=["attn.o", "mlp.gate_up"], seed=9))
    assert pool.slot_routed_host == [True, False, False]
    pool.unload(0)
    assert pool.slot_routed_host == [False, False, False]


def test_unload_zeroes_the_slot_only() -> None:
    pool = _pool()
    first, second = (random_adapter(_config(), 8, seed=s) for s in (4, 5))
    pool.load(0, first)
    pool.load(2, second)
    assert pool.unload(0).done()
    assert_slot_empty(pool, 0)
    assert_slot_holds(pool, 2, second)


def test_pool_dtype_conversion_on_load() -> None:
    pool = _pool(dtype=torch.bfloat16)
    adapter = random_adapter(_config(), 8, seed=6)
    pool.load(2, adapter)
    assert_slot_holds(pool, 2, adapter)  # compares against the tensors cast to bf16


def test_model_without_q_lora_rank() -> None:
    pool = _pool("v3_no_q_lora")
    modules = {module for _, module in pool.module_instances()}
    assert "attn.q" in modules and "attn.q_b" not in modules
    assert pool.lora_a(0, "attn.qkv_a").shape == (3, MAX_RANK, 64)  # kv_a alone
    assert pool.lora_b(0, "attn.qkv_a").shape == (3, 32 + 8, MAX_RANK)
    assert pool.lora_b(0, "attn.q").shape == (3, 4 * (16 + 8), MAX_RANK)
    adapter = random_adapter(_config("v3_no_q_lora"), 5, seed=7)
    pool.load(1, adapter)
    assert_slot_holds(pool, 1, adapter)


def test_incompatible_adapters_are_refused_before_any_copy() -> None:
    pool = _pool()
    with pytest.raises(FailedPrecondition, match="rank 32 exceeds .* max_lora_rank 16"):
        pool.load(0, random_adapter(_config(), 32))
    with pytest.raises(FailedPrecondition, match="attn.q, which the base model lacks"):
        pool.load(0, random_adapter(_config("v3_no_q_lora"), 4, modules=["attn.q"]))
    with pytest.raises(FailedPrecondition, match="do not fit the base model"):
        pool.load(0, random_adapter(_config("v3_wide"), 4, modules=["attn.o"]))
    assert_slot_empty(pool, 0)
    with pytest.raises(IndexError):
        pool.load(3, random_adapter(_config(), 4))


def _tiny_slot_elements(r: int) -> int:
    """Elements of one slot of the v3_q_lora tiny model, written out from its config:
    hidden 64, 4 heads, q_lora 48, kv_lora 32, rope 8, nope 16, v 16, dense inter 96,
    moe inter 32 (1 shared expert), 8 experts, 3 layers of which layer 0 is dense."""
    attention = (2 * r * 64 + (48 + 40) * r) + (r * 48 + 96 * r) + (r * 32 + 128 * r)
    attention += r * 64 + 64 * r
    dense_mlp = (2 * r * 64 + 192 * r) + (r * 96 + 64 * r)
    shared_mlp = (2 * r * 64 + 64 * r) + (r * 32 + 64 * r)
    experts = 8 * ((2 * r * 64 + 64 * r) + (r * 32 + 64 * r))
    return 3 * attention + dense_mlp + 2 * (shared_mlp + experts)


def test_slot_bytes_matches_config_arithmetic() -> None:
    shapes = model_lora_shapes(_config())
    assert slot_bytes(shapes, 16, torch.float32) == 4 * _tiny_slot_elements(16)
    assert slot_bytes(shapes, 64, torch.bfloat16) == 2 * _tiny_slot_elements(64)


def test_sizing_from_memory_budget(caplog, monkeypatch) -> None:
    shapes = model_lora_shapes(_config())
    per_slot = 2 * _tiny_slot_elements(MAX_RANK)
    # The budget pays for the two staging halves first (here: one slot's bytes in all).
    staging = 2 * 2 * staging_elements(shapes, MAX_RANK, torch.bfloat16, 1 << 30)
    assert staging == per_slot
    budget_gb = (3.5 * per_slot + staging) / (1 << 30)
    config = LoraPoolConfig(MAX_RANK, torch.bfloat16, "cpu", lora_memory_gb=budget_gb)
    with caplog.at_level(logging.INFO, logger=pool_module.__name__):
        assert plan_num_slots(config, shapes) == 3
    assert "LoRA pool: 3 slots of rank 16 (bfloat16" in caplog.text
    capped = LoraPoolConfig(MAX_RANK, torch.bfloat16, "cpu", max_loras=2, lora_memory_gb=budget_gb)
    assert plan_num_slots(capped, shapes) == 2

    monkeypatch.setattr(pool_module, "free_memory_bytes", lambda device: 12 * per_slot)
    half = LoraPoolConfig(MAX_RANK, torch.bfloat16, "cpu", lora_memory_fraction=0.5)
    assert plan_num_slots(half, shapes) == 5
    tiny_budget = LoraPoolConfig(MAX_RANK, torch.bfloat16, "cpu", lora_memory_fraction=0.1)
    with pytest.raises(ValueError, match="holds no slot of rank 16"):
        plan_num_slots(tiny_budget, shapes)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_lora_rank": 0, "max_loras": 1},
        {"max_lora_rank": 8},
        {"max_lora_rank": 8, "lora_memory_gb": 1.0, "lora_memory_fraction": 0.5},
        {"max_lora_rank": 8, "lora_memory_fraction": 1.5},
        {"max_lora_rank": 8, "max_loras": 1, "dtype": torch.int8},
    ],
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LoraPoolConfig(**kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
def test_cuda_load_on_side_stream(layout: str) -> None:
    config = LoraPoolConfig(MAX_RANK, torch.bfloat16, "cuda", max_loras=4)
    pool = LoraPool.from_config(model_lora_shapes(_config()), config)
    adapter = random_adapter(_config(), 8, moe_layout=layout, dtype=torch.bfloat16, seed=8)
    adapter.tensors = {name: t.pin_memory() for name, t in adapter.tensors.items()}
    load = pool.load(3, adapter)
    assert load.event is not None
    load.wait_on()
    torch.cuda.current_stream().synchronize()
    assert load.done()
    assert_slot_holds(host_copy(pool), 3, adapter)
    assert pool.slot_rank.tolist() == [0, 0, 0, 8]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_load_and_unload_never_wait_for_the_gpu(packed: bool) -> None:
    """The engine thread issues slot loads between steps: a load (or unload) that waited
    for the side stream's queued copies stalled every running request for the adapter's
    transfer time. The GPU is kept busy first; the calls must return before it is done."""
    config = LoraPoolConfig(MAX_RANK, torch.bfloat16, "cuda", max_loras=2)
    pool = LoraPool.from_config(model_lora_shapes(_config()), config)
    adapter = random_adapter(_config(), 8, dtype=torch.bfloat16, seed=9)
    if packed:
        source = pool.packing.pack(adapter, pin=True)
    else:
        source = adapter
        source.tensors = {name: t.pin_memory() for name, t in adapter.tensors.items()}
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time; the side stream waits for it
    busy = torch.cuda.Event()
    busy.record()
    load = pool.load(0, source)
    unload = pool.unload(1)
    assert not busy.query(), "load/unload waited for the GPU"
    load.wait_on()
    unload.wait_on()
    torch.cuda.synchronize()
    assert_slot_holds(host_copy(pool), 0, adapter)


class _Dense:
    """A dense module as `LoraPool.carry_base_weights` sees it."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def keep_weight_in(self, carrier: torch.Tensor) -> None:
        self.weight = carrier[: self.weight.shape[0]]


def _dense_modules(pool: LoraPool, seed: int) -> dict[tuple[int, str], _Dense]:
    gen = torch.Generator().manual_seed(seed)
    return {
        (layer, module): _Dense(torch.randn(pool.lora_b(layer, module).shape[1],
                                            pool.lora_a(layer, module).shape[-1], generator=gen))
        for layer, module in pool.module_instances()
        if not module.startswith("moe.")
    }  # fmt: skip


def _assert_carried(pool: LoraPool, modules: dict, weights: dict) -> None:
    """Each carrier is the module's weight (the module reading it there) above the module
    instance's A buffer, the two sharing its memory."""
    for (layer, module), dense in modules.items():
        carrier = pool.carrier(layer, module)
        a = pool.lora_a(layer, module)
        n = weights[layer, module].shape[0]
        assert carrier.shape == (n + a.shape[0] * a.shape[1], a.shape[2]) and a.is_contiguous()
        assert torch.equal(carrier[:n], weights[layer, module])
        assert dense.weight.data_ptr() == carrier.data_ptr()
        assert a.data_ptr() == carrier[n:].data_ptr()


@pytest.mark.parametrize("packed", [False, True])
def test_carried_base_weights_sit_above_every_slots_a_rows(packed: bool) -> None:
    """`carry_base_weights` moves the dense modules' weights into the pool, A buffers and
    their contents with them (a slot loaded before); loads (tensor and packed paths) and
    unloads afterwards land in the carriers; a second carry of the same modules is a no-op,
    another model's is refused; expert modules and groups given in part are not carried."""
    pool = _pool()
    first, second = (random_adapter(_config(), 8, seed=seed) for seed in (21, 22))

    def load(slot, adapter):  # type: ignore[no-untyped-def]
        pool.load(slot, pool.packing.pack(adapter) if packed else adapter)

    load(1, first)
    load(1, first)  # both staging halves: the packed path's views of slot 1 all cached
    modules = _dense_modules(pool, seed=23)
    weights = {key: dense.weight.clone() for key, dense in modules.items()}
    partial = {key: dense for key, dense in modules.items() if key != (0, "attn.o")}
    pool.carry_base_weights(partial)
    assert pool.carrier(0, "attn.o") is None and pool.carrier(1, "attn.o") is None
    pool.carry_base_weights(modules)
    _assert_carried(pool, modules, weights)
    experts = [key for key in pool.module_instances() if key[1].startswith("moe.")]
    assert all(pool.carrier(*key) is None for key in experts)
    assert_slot_holds(pool, 1, first)
    load(1, second)  # the layout and slot of a load before: no view of the old A buffers
    load(2, first)
    assert_slot_holds(pool, 1, second)
    pool.unload(1)
    assert_slot_empty(pool, 1)
    assert_slot_holds(pool, 2, first)
    _assert_carried(pool, modules, weights)
    pool.carry_base_weights(modules)
    _assert_carried(pool, modules, weights)
    with pytest.raises(ValueError, match="carries another model's weights"):
        pool.carry_base_weights(_dense_modules(pool, seed=24))


def test_carried_weights_must_fit_the_pool() -> None:
    pool = _pool()
    modules = _dense_modules(pool, seed=25)
    modules[1, "attn.o"] = _Dense(modules[1, "attn.o"].weight[:, :-1])
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.o: weight"):
        pool.carry_base_weights(modules)
