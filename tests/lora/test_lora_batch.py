"""LoRA batch metadata (slots per token / sequence, decode segments) and pool attachment."""

from __future__ import annotations

import pytest
import torch

from adapter_store.format import model_lora_shapes
from inference_svc.engine.batch import SequenceStep, build_batch, prefill_groups
from inference_svc.engine.model_runner import ModelRunner, RunnerConfig
from inference_svc.lora.batch import LoraScope, build_lora_batch
from inference_svc.lora.pool import LoraPool, LoraPoolConfig
from inference_svc.model.config import parse_config
from inference_svc.model.loader import build_model
from tests.fixtures.tiny_models import tiny_config

RANKS = torch.tensor([4, 0, 8], dtype=torch.int32)


def _step(query_len: int, slot: int) -> SequenceStep:
    return SequenceStep(0 if query_len > 1 else 3, query_len, (0, 1), lora_slot=slot)


def _live(segs) -> list[tuple[int, int, int]]:
    """(first token, end token, slot) of each live segment."""
    n = segs.num_live_segments
    bounds, slots = segs.seg_indptr[: n + 1].tolist(), segs.seg_slot[:n].tolist()
    return [(bounds[i], bounds[i + 1], slots[i]) for i in range(n)]


def test_no_adapter_means_no_lora_metadata():
    batch = build_batch([_step(1, -1), _step(5, -1)], 4, "cpu", RANKS)
    assert batch.lora is None


def test_adapter_without_pool_is_an_error():
    with pytest.raises(ValueError, match="no LoRA pool"):
        build_batch([_step(3, 0)], 4, "cpu")


def test_slot_outside_the_pool_is_an_error():
    with pytest.raises(ValueError, match="token slots"):
        build_batch([_step(3, 3)], 4, "cpu", RANKS)


def test_the_batch_says_whether_an_adapter_targets_the_routed_experts():
    """`routed_experts` from the slots the step's sequences use (the base model's -1 and
    the other slots do not count); without the pool's mirror every adapter is assumed to."""
    routed = [True, False, True]  # slot 2 last: the base model's -1 must not index it
    seqs = [_step(1, 1), _step(1, -1), _step(3, 1)]
    assert build_batch(seqs, 4, "cpu", RANKS, routed).lora.routed_experts is False
    assert build_batch(seqs, 4, "cpu", RANKS).lora.routed_experts is True
    seqs.append(_step(2, 0))
    assert build_batch(seqs, 4, "cpu", RANKS, routed).lora.routed_experts is True
    assert build_lora_batch([1, 0], [1, 1], 2, RANKS, "cpu", slot_routed=routed).routed_experts


def test_mixed_step_gets_separate_decode_segments():
    # Decode of slot 2, then prefills of slot 2 (adjacent: one run across the boundary),
    # base, slot 0.
    seqs = [_step(1, 2), _step(1, -1), _step(3, 2), _step(2, -1), _step(4, 0)]
    lora = build_batch(seqs, 4, "cpu", RANKS).lora
    assert lora.token_slots == (2, -1, 2, 2, 2, -1, -1, 0, 0, 0, 0)
    assert lora.seq_slots == (2, -1, 2, -1, 0)
    assert _live(lora.tokens) == [(0, 1, 2), (1, 2, -1), (2, 5, 2), (5, 7, -1), (7, 11, 0)]
    assert lora.tokens.slot_rank.tolist() == RANKS.tolist()
    assert lora.decode_tokens.num_tokens == 2
    assert _live(lora.decode_tokens) == [(0, 1, 2), (1, 2, -1)]


def test_prefill_context_rows_get_segments_per_group(monkeypatch):
    """Prefill K/V rows: each prefill sequence's whole context (cached + new) with its slot,
    end to end per group; a group without adapters has none."""
    monkeypatch.setattr("inference_svc.engine.batch.PREFILL_GROUP_ROWS", 9)
    seqs = [_step(1, 2), SequenceStep(2, 3, (0, 1), lora_slot=0), _step(4, -1), _step(5, 2)]
    batch = build_batch(seqs, 4, "cpu", RANKS)
    # contexts 5, 4, 5 (decode first is not a prefill): 5 + 4 fit in 9 rows, 5 does not.
    assert batch.prefill_groups == ((1, 3), (3, 4))
    first, second = batch.lora.context_rows
    assert first.num_tokens == 9 and _live(first) == [(0, 5, 0), (5, 9, -1)]
    assert second.num_tokens == 5 and _live(second) == [(0, 5, 2)]
    base_only = build_batch([_step(1, 2), _step(4, -1)], 4, "cpu", RANKS)
    assert base_only.prefill_groups == ((1, 2),) and base_only.lora.context_rows == (None,)


@pytest.mark.parametrize(
    "contexts,first,max_rows,groups",
    [
        ([3, 4, 5], 0, 100, ((0, 3),)),
        ([3, 4, 5], 1, 9, ((1, 3),)),
        ([3, 4, 5], 0, 7, ((0, 2), (2, 3))),
        ([10, 2, 2, 10], 0, 4, ((0, 1), (1, 3), (3, 4))),  # a long context is a group alone
        ([1, 1], 2, 8, ()),  # no prefill sequence
    ],
)
def test_prefill_groups_cover_every_prefill_sequence_once(contexts, first, max_rows, groups):
    assert prefill_groups(contexts, first, max_rows) == groups


def test_decode_only_step_shares_its_segments():
    lora = build_batch([_step(1, 0), _step(1, 0), _step(1, 2)], 4, "cpu", RANKS).lora
    assert lora.decode_tokens is lora.tokens
    assert _live(lora.tokens) == [(0, 2, 0), (2, 3, 2)]


@pytest.mark.parametrize(
    "query_lens,num_decodes", [((1, 1, 1, 1), 4), ((1, 1, 3, 2), 2), ((4, 5, 2, 3), 0)]
)
def test_token_slots_repeat_each_sequence_slot_over_its_tokens(query_lens, num_decodes):
    seq_slots = (2, -1, 0, 2)
    lora = build_lora_batch(seq_slots, query_lens, num_decodes, RANKS, "cpu")
    want = tuple(slot for slot, n in zip(seq_slots, query_lens, strict=True) for _ in range(n))
    assert lora.token_slots == want and all(type(slot) is int for slot in lora.token_slots)
    assert lora.tokens.token_slot[: len(want)].tolist() == list(want)


def test_decodes_on_the_base_model_get_no_decode_segments():
    lora = build_batch([_step(1, -1), _step(6, 2)], 4, "cpu", RANKS).lora
    assert lora.decode_tokens is None
    assert _live(lora.tokens) == [(0, 1, -1), (1, 7, 2)]


def _model(spec: str):
    return build_model(parse_config(tiny_config(spec).to_dict()), "cpu", torch.float32)


def _pool(spec: str, dtype=torch.float32) -> LoraPool:
    shapes = model_lora_shapes(tiny_config(spec).to_dict())
    return LoraPool(shapes, 2, LoraPoolConfig(4, dtype=dtype, device="cpu", max_loras=2))


def test_attach_gives_every_module_its_layer_buffers():
    model = _model("v3_q_lora")
    pool = _pool("v3_q_lora")
    ModelRunner(model, RunnerConfig(num_pages=4), pool)
    layer0, layer2 = model.layers[0], model.layers[2]
    assert layer0.attn.qkv_a.lora.a.data_ptr() == pool.lora_a(0, "attn.qkv_a").data_ptr()
    assert layer0.mlp.gate_up.lora.b.shape == (2, 2 * 96, 4)  # dense MLP
    assert layer2.mlp.down.lora.a.shape == (2, 4, 32)  # shared experts
    assert layer2.moe.lora_gate_up.a.data_ptr() == pool.lora_a(2, "moe.gate_up").data_ptr()
    assert layer2.attn.kv_b.lora.b.data_ptr() == pool.lora_b(2, "attn.kv_b").data_ptr()


def test_attach_moves_the_carried_modules_weights_into_the_pool():
    """qkv_a, o and the MLPs read their weights from the pool's carriers (weights above the
    A rows, values unchanged, the A views the carriers' tails); q_b, kv_b and the experts
    keep their own. A second runner on the same model and pool finds them carried."""
    from inference_svc.lora.attach import CARRIED_MODULES

    model = _model("v3_q_lora")
    pool = _pool("v3_q_lora")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ModelRunner(model, RunnerConfig(num_pages=4), pool)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    layer = model.layers[2]
    linears = {
        "attn.qkv_a": layer.attn.qkv_a, "attn.o": layer.attn.o, "mlp.gate_up": layer.mlp.gate_up,
        "mlp.down": layer.mlp.down, "attn.q_b": layer.attn.q_b, "attn.kv_b": layer.attn.kv_b,
    }  # fmt: skip
    for module, linear in linears.items():
        carrier = pool.carrier(2, module)
        assert (carrier is not None) == (module in CARRIED_MODULES), module
        assert (linear.lora.carrier is carrier) or (carrier is None and linear.lora.carrier is None)
        if carrier is not None:
            n = linear.out_features
            assert linear.weight.data_ptr() == carrier.data_ptr()
            assert linear.lora.a.data_ptr() == carrier[n:].data_ptr()
    ModelRunner(model, RunnerConfig(num_pages=4), pool)
    assert layer.attn.o.weight.data_ptr() == pool.carrier(2, "attn.o").data_ptr()


@pytest.mark.parametrize(
    "pool_spec,dtype,message",
    [
        ("v3_no_q_lora", torch.float32, "does not fit the model"),
        ("v3_wide", torch.float32, "does not fit"),
        ("v3_q_lora", torch.float16, "float16"),
    ],
)
def test_attach_refuses_a_pool_of_another_model(pool_spec, dtype, message):
    with pytest.raises(ValueError, match=message):
        ModelRunner(_model("v3_q_lora"), RunnerConfig(num_pages=4), _pool(pool_spec, dtype))


def test_a_decode_step_replays_the_graph_of_its_lora_scope():
    """The smallest captured size of the step's scope: no LoRA, LoRA on every module, or LoRA
    off the routed experts (`LoraBatch.routed_experts`), whose steps take the full LoRA
    graph where none was captured for them (a pool without routed-expert modules)."""
    pool = _pool("v3_q_lora")
    runner = ModelRunner(_model("v3_q_lora"), RunnerConfig(num_pages=8), pool)
    graphs = {(size, scope): object() for size in (1, 4) for scope in LoraScope}
    runner._graphs = dict(graphs)
    routed = [True, False]

    def graph(*slots: int, decode: bool = True):  # type: ignore[no-untyped-def]
        steps = [_step(1 if decode else 3, slot) for slot in slots]
        return runner._graph_for(build_batch(steps, 4, "cpu", pool.slot_rank, routed))

    assert graph(-1, -1) is graphs[4, LoraScope.NONE]
    assert graph(1, 0) is graphs[4, LoraScope.ALL]
    assert graph(1) is graphs[1, LoraScope.NOT_ROUTED]
    assert graph(1, -1) is graphs[4, LoraScope.NOT_ROUTED]
    assert graph(1, decode=False) is None
    del runner._graphs[1, LoraScope.NOT_ROUTED], runner._graphs[4, LoraScope.NOT_ROUTED]
    runner.graph_scopes = LoraScope.captured(False)  # as for a pool without routed experts
    assert graph(1) is graphs[1, LoraScope.ALL]


def test_graphs_are_captured_per_lora_scope_the_pool_can_need():
    """No pool: only the no-LoRA graphs; a pool: the LoRA ones too, and graphs without the
    routed experts' LoRA only where the pool holds routed-expert weights."""
    assert LoraScope.captured(None) == (LoraScope.NONE,)
    assert LoraScope.captured(False) == (LoraScope.NONE, LoraScope.ALL)
    assert set(LoraScope.captured(True)) == set(LoraScope)
    runner = ModelRunner(_model("v3_q_lora"), RunnerConfig(num_pages=8), _pool("v3_q_lora"))
    assert runner.graph_scopes == LoraScope.captured(runner.lora_pool.holds_routed_experts)
