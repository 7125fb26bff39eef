"""Our logprobs with adapters in the slot pool == transformers + peft (float32, CPU).

Adapters are made by peft itself (random non-zero lora_A/lora_B on every MLA projection and
the routed experts), normalized like an upload, and loaded into the pool. The dense and
shared-expert MLP layouts, which peft cannot apply on transformers 5, are checked against
the base model with the adapter's ΔW merged into its weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.random_adapters import random_adapter
from tests.fixtures.tiny_models import build_tiny_model, tiny_config
from tests.lora.harness import (
    TOL,
    Scenario,
    Seq,
    make_runner,
    max_logprob_diff,
    oracle_logprobs,
    peft_case,
    random_tokens,
    small_lora_b,
)
from tests.normalize.peft_adapters import merged_base_model

SPECS = ["v3_q_lora", "v3_no_q_lora"]


def _check(scenario: Scenario, oracles: list[torch.nn.Module], base=None) -> None:
    """Each sequence's logprobs equal its oracle's; an adapted sequence must also differ
    clearly from the base model, or the comparison would not show the adapter acted."""
    for seq, oracle in zip(scenario.seqs, oracles, strict=True):
        expected = oracle_logprobs(oracle, seq.tokens)
        diff = max_logprob_diff(seq, expected)
        assert diff <= TOL, f"slot {seq.slot}: max |Δlogprob| {diff:.2e}"
        if base is not None and seq.slot >= 0:
            assert (expected - oracle_logprobs(base, seq.tokens)).abs().max() > 0.05


@pytest.mark.parametrize("spec", SPECS)
def test_one_peft_adapter_prefill(spec, tiny_model_dirs):
    peft_model, adapter = peft_case(spec, rank=4, seed=1)
    runner = make_runner(tiny_model_dirs[spec], spec, num_slots=3, max_rank=16)
    runner.lora_pool.load(1, adapter)
    (tokens,) = random_tokens([17], seed=2)
    scenario = Scenario(runner, [Seq(tokens, slot=1)])
    scenario.step([len(tokens)])
    _check(scenario, [peft_model], base=build_tiny_model(spec))


@pytest.mark.parametrize("group_rows", [None, 12], ids=["one_group", "groups_of_12_rows"])
@pytest.mark.parametrize("spec", SPECS)
def test_mixed_adapters_and_base_in_one_batch_prefill_and_decode(
    spec, tiny_model_dirs, group_rows, monkeypatch
):
    """Adapters of ranks 4, 8 and 16 (one with rslora and patterns) and the base model share
    every step: prefill chunks on a cached prefix, a step mixing decodes and prefills, then
    paged decodes through the absorbed kv_b correction, sequences ending unevenly. With
    `group_rows` the prefill K/V expansion is cut into groups of sequences (and a context
    longer than a group alone), each with its own context-row LoRA segments."""
    if group_rows is not None:
        monkeypatch.setattr("inference_svc.engine.batch.PREFILL_GROUP_ROWS", group_rows)
    runner = make_runner(tiny_model_dirs[spec], spec, num_slots=4, max_rank=16)
    cases = [
        peft_case(spec, rank=4, seed=3),
        peft_case(spec, rank=8, seed=4, use_rslora=True, rank_pattern={"o_proj": 5}),
        peft_case(spec, rank=16, seed=5, lora_alpha=8),
    ]
    for slot, (_, adapter) in zip((2, 0, 3), cases, strict=True):
        runner.lora_pool.load(slot, adapter)
    base = build_tiny_model(spec)
    tokens = random_tokens([14, 11, 9, 12, 10], seed=6)
    # Two sequences on slot 2, neighbours in the batch like the scheduler groups them.
    slots = [2, 2, -1, 0, 3]
    oracles = [cases[0][0], cases[0][0], base, cases[1][0], cases[2][0]]
    scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, slots, strict=True)])
    scenario.run([6, 5, 4, 0, 7], [1, 3, 1, 6, 0], [1, 3, 1, 1, 3])
    _check(scenario, oracles, base)


def test_rank8_adapter_in_rank16_pool_is_exact(tiny_model_dirs):
    spec = "v3_q_lora"
    peft_model, adapter = peft_case(spec, rank=8, seed=7)
    tokens = random_tokens([9, 13], seed=8)
    logprobs = []
    for max_rank in (8, 16):
        runner = make_runner(tiny_model_dirs[spec], spec, num_slots=2, max_rank=max_rank)
        runner.lora_pool.load(1, adapter)
        scenario = Scenario(runner, [Seq(t, slot=1) for t in tokens])
        scenario.run([5, 8])
        _check(scenario, [peft_model, peft_model])
        logprobs.append(torch.cat([torch.stack(s.logprobs) for s in scenario.seqs]))
    torch.testing.assert_close(logprobs[0], logprobs[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
def test_dense_and_shared_mlp_layouts_against_merged_weights(layout, tiny_model_dirs):
    """Every canonical module (dense-layer MLP of width 96, shared-expert MLP of width 32,
    attention, routed experts per-expert or shared-outer), next to the base model."""
    scenario, adapters = _random_adapters_scenario(
        tiny_model_dirs, ((6, 9), (3, 10)), 0.02, layout, [10, 8, 12], seed=11
    )
    scenario.run([4, 8, 5])
    _check_against_merged_weights(scenario, adapters)


def _random_adapters_scenario(tiny_model_dirs, ranks_seeds, scale, layout, lengths, seed):  # type: ignore[no-untyped-def]
    """Random adapters on every canonical module (lora_B scaled by `scale`) of ranks and
    seeds `ranks_seeds` in slots 0, 1, and three sequences of `lengths` random tokens using
    slots 1, -1 and 0: (scenario, adapters)."""
    spec = "v3_q_lora"
    hf_config = tiny_config(spec).to_dict()
    adapters = [
        small_lora_b(random_adapter(hf_config, rank, moe_layout=layout, seed=s), scale)
        for rank, s in ranks_seeds
    ]
    runner = make_runner(tiny_model_dirs[spec], spec, num_slots=2, max_rank=8)
    for slot, adapter in enumerate(adapters):
        runner.lora_pool.load(slot, adapter)
    tokens = random_tokens(lengths, seed=seed)
    scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, [1, -1, 0], strict=True)])
    return scenario, adapters


def _check_against_merged_weights(scenario: Scenario, adapters) -> None:  # type: ignore[no-untyped-def]
    """`_random_adapters_scenario`'s sequences against the base model with each one's
    adapter's ΔW merged (and the base model itself)."""
    spec, base = "v3_q_lora", build_tiny_model("v3_q_lora")
    oracles = [merged_base_model(spec, adapters[1]), base, merged_base_model(spec, adapters[0])]
    _check(scenario, oracles, base)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_long_steps_add_the_gate_up_lora_in_the_activation(tiny_model_dirs, monkeypatch, kernels):
    """Prompt steps from 4 tokens (the threshold lowered for the tiny model) take gate_up's
    LoRA expand inside SiLU·mul, in the dense layer's MLP and the shared experts'; decode
    steps the separate launches. Both against the merged-weight oracles."""
    from inference_svc.layers import moe
    from inference_svc.lora import apply

    if kernels == "triton":
        _route_through_triton(monkeypatch, "auto")
    monkeypatch.setattr(apply, "GATE_UP_EXPAND_WITH_SILU_MIN_TOKENS", 4)
    fused_calls = []

    def counted(pending, gate_up, weights):  # type: ignore[no-untyped-def]
        fused_calls.append(gate_up.shape[0])
        return apply.finish_gate_up_lora_with_silu(pending, gate_up, weights)

    monkeypatch.setattr(moe, "finish_gate_up_lora_with_silu", counted)
    scenario, adapters = _random_adapters_scenario(
        tiny_model_dirs, ((8, 25), (3, 26)), 0.05, "per_expert", [9, 7, 11], seed=27
    )
    scenario.run([4, 6, 5])
    layers_with_mlp = sum(layer.mlp is not None for layer in scenario.runner.model.layers)
    assert fused_calls == [15] * layers_with_mlp  # the prompt step only, every MLP of it
    _check_against_merged_weights(scenario, adapters)


def test_batch_without_adapters_does_no_lora_work(tiny_model_dirs, monkeypatch):
    """Slot -1 everywhere: no LoRA metadata, no LoRA call, the base model's logits."""
    from inference_svc.lora import apply

    spec = "v3_q_lora"
    _, adapter = peft_case(spec, rank=4, seed=12)
    runner = make_runner(tiny_model_dirs[spec], spec, num_slots=2, max_rank=4)
    runner.lora_pool.load(0, adapter)
    for name in ("sgmv_shrink_ref", "mla_kv_b_lora_q_ref", "moe_lora_gate_up_ref"):
        monkeypatch.setattr(apply, name, _must_not_run)
    tokens = random_tokens([7, 9], seed=13)
    scenario = Scenario(runner, [Seq(t, slot=-1) for t in tokens])
    scenario.run([7, 5])
    base = build_tiny_model(spec)
    _check(scenario, [base, base])


def _must_not_run(*args, **kwargs):
    raise AssertionError("a batch without adapters ran a LoRA kernel")


def _route_through_triton(monkeypatch, moe_variant: str) -> None:
    """Make the model's LoRA calls take the Triton launchers (interpreted on the CPU);
    moe_variant "in_gemm" adds the MoE expand in the grouped GEMM's epilogue (the GEMM's
    Triton launcher too)."""
    import functools

    from inference_svc.lora import apply
    from kernels import gated_expand, mla_lora, mla_q_lora, moe_lora, sgmv

    for module, names in (
        (sgmv, ("sgmv_shrink", "sgmv_expand")),
        (gated_expand, ("sgmv_expand_silu_mul",)),
        (mla_lora, ("mla_kv_b_lora_q", "mla_kv_b_lora_o")),
        (mla_q_lora, ("q_b_expand_kv_b_q",)),
        (moe_lora, ("moe_lora_gate_up", "moe_lora_down", "moe_lora_epilogue")),
    ):
        for name in names:
            launcher = getattr(module, name)
            if name in ("moe_lora_gate_up", "moe_lora_down") and moe_variant != "in_gemm":
                launcher = functools.partial(launcher, variant=moe_variant)
            monkeypatch.setattr(apply, f"{name}_ref", launcher)
    monkeypatch.setattr(
        apply, "MOE_LORA_IN_GEMM", "always" if moe_variant == "in_gemm" else "never"
    )
    if moe_variant == "in_gemm":  # the grouped GEMM with its LoRA epilogue, interpreted
        from kernels import fused_moe

        monkeypatch.setattr(fused_moe, "grouped_gemm_ref", fused_moe.grouped_gemm)


@pytest.mark.parametrize("moe_variant", ["auto", "runs", "in_gemm"])
def test_triton_lora_kernels_in_the_model_match_peft(tiny_model_dirs, monkeypatch, moe_variant):
    """The LoRA deltas through the Triton launchers (interpreted on CPU): their integration
    (strides of q_nope / q_lat views, stacked slices, per-pair MoE rows, decode segments of
    a mixed step) checked end to end. The tiny batches take the "pairs" MoE kernel; "runs"
    (prefill-sized batches) walks the pairs in the base MoE's expert order; "in_gemm" (long
    batches) runs the shrink and leaves the expand to the grouped GEMM."""
    _route_through_triton(monkeypatch, moe_variant)
    spec = "v3_q_lora"
    runner = make_runner(tiny_model_dirs[spec], spec, num_slots=3, max_rank=16)
    cases = [peft_case(spec, rank=4, seed=14), peft_case(spec, rank=16, seed=15)]
    for slot, (_, adapter) in zip((2, 0), cases, strict=True):
        runner.lora_pool.load(slot, adapter)
    tokens = random_tokens([6, 7, 5], seed=16)
    scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, [2, -1, 0], strict=True)])
    scenario.run([3, 4, 0], [1, 1, 3])
    _check(scenario, [cases[0][0], build_tiny_model(spec), cases[1][0]])


@pytest.mark.parametrize("fused", [True, False], ids=["one_launch", "two_launches"])
@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_decode_steps_expand_q_b_with_kv_b_query_correction(
    tiny_model_dirs, monkeypatch, kernels, fused
):
    """Steps of decodes only take q_b's expand and kv_b's query correction together
    (`apply.finish_q_b_lora_with_kv_b_q`), steps with a prompt the two separate calls; with
    the fused call switched off, decodes take the separate ones too. Adapters of ranks 4
    and 16 (whose q_b and kv_b ranks differ by rank_pattern) and the base share the batch,
    and each sequence's logprobs equal its peft model's."""
    from inference_svc.lora import apply

    if kernels == "triton":
        _route_through_triton(monkeypatch, "auto")
    monkeypatch.setattr(apply, "Q_B_EXPAND_WITH_KV_B_Q", fused)
    rows: dict[str, list[int]] = {"fused": [], "separate": []}
    for name, key in (("q_b_expand_kv_b_q_ref", "fused"), ("mla_kv_b_lora_q_ref", "separate")):
        monkeypatch.setattr(apply, name, _recording(getattr(apply, name), rows[key]))
    spec = "v3_q_lora"
    runner = make_runner(tiny_model_dirs[spec], spec, num_slots=3, max_rank=16)
    cases = [
        peft_case(spec, rank=4, seed=20, rank_pattern={"kv_b_proj": 2}),
        peft_case(spec, rank=16, seed=21, rank_pattern={"q_b_proj": 8}),
    ]
    for slot, (_, adapter) in zip((2, 0), cases, strict=True):
        runner.lora_pool.load(slot, adapter)
    tokens = random_tokens([6, 7, 5], seed=22)
    scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, [2, -1, 0], strict=True)])
    scenario.run([3, 4, 0], [1, 1, 3])
    _check(scenario, [cases[0][0], build_tiny_model(spec), cases[1][0]], build_tiny_model(spec))
    layers = tiny_config(spec).num_hidden_layers
    decode_rows = [3] * 2 * layers  # the two decode-only steps after the prompt steps
    prompt_step_rows = [2] * layers  # the second prompt step's two decodes
    if fused:
        assert rows["fused"] == decode_rows
        assert rows["separate"] == prompt_step_rows
    else:
        assert rows["fused"] == []
        assert rows["separate"] == prompt_step_rows + decode_rows


def _recording(launcher, rows: list[int]):  # type: ignore[no-untyped-def]
    """`launcher`, recording the token count of each call (its first argument's rows:
    q_nope for the query correction, q for the fused call)."""

    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        rows.append(args[0].shape[0])
        return launcher(*args, **kwargs)

    return run


@pytest.mark.parametrize("spec", SPECS)
def test_steps_without_routed_expert_adapters_skip_the_moe_lora(spec, tiny_model_dirs, monkeypatch):
    """A step none of whose adapters targets the routed experts runs the MoE without LoRA
    (`LoraBatch.routed_experts`), and still equals peft; a step with one that does runs the
    MoE LoRA for the whole step, its attention-only neighbour included."""
    from inference_svc.layers import moe

    moe_lora_calls = []
    for name in ("add_moe_gate_up", "add_moe_down", "start_moe_lora"):
        launcher = getattr(moe, name)

        def counted(*args, _launcher=launcher, _name=name, **kwargs):
            moe_lora_calls.append(_name)
            return _launcher(*args, **kwargs)

        monkeypatch.setattr(moe, name, counted)
    runner = make_runner(tiny_model_dirs[spec], spec, num_slots=2, max_rank=8)
    attention_only = peft_case(spec, rank=4, seed=21, target_parameters=None)
    with_experts = peft_case(spec, rank=8, seed=22)
    for slot, (_, adapter) in enumerate((attention_only, with_experts)):
        runner.lora_pool.load(slot, adapter)
    base = build_tiny_model(spec)
    (tokens,) = random_tokens([9], seed=23)
    alone = Scenario(runner, [Seq(tokens, 0)])
    alone.run([6])
    assert moe_lora_calls == []
    _check(alone, [attention_only[0]], base=base)
    both = Scenario(runner, [Seq(tokens, 0), Seq(tokens, 1)])
    both.step([6, 6])
    assert moe_lora_calls
    both.run()
    _check(both, [attention_only[0], with_experts[0]], base=base)


@pytest.mark.parametrize(
    "kernels", ["reference", "reference_in_gemm", "triton", "triton_runs", "triton_in_gemm"]
)
def test_modules_an_adapter_does_not_target_are_not_read(tiny_model_dirs, monkeypatch, kernels):
    """An attention-only adapter next to one on the routed experts: the MoE LoRA kernels
    read its slot at rank 0 (`LoraPool.rank_of`), so even garbage in its (untargeted) expert
    buffers changes nothing; the other adapter's expert LoRA still acts."""
    from inference_svc.lora import apply

    if kernels == "reference_in_gemm":
        monkeypatch.setattr(apply, "MOE_LORA_IN_GEMM", "always")
    elif kernels != "reference":
        variant = {"triton": "auto", "triton_runs": "runs", "triton_in_gemm": "in_gemm"}[kernels]
        _route_through_triton(monkeypatch, variant)
    spec = "v3_q_lora"
    runner = make_runner(tiny_model_dirs[spec], spec, num_slots=2, max_rank=8)
    attention_only = peft_case(spec, rank=4, seed=17, target_parameters=None)
    with_experts = peft_case(spec, rank=8, seed=18)
    for slot, (_, adapter) in enumerate((attention_only, with_experts)):
        runner.lora_pool.load(slot, adapter)
    pool = runner.lora_pool
    for layer, module in pool.module_instances():
        if module.startswith("moe."):
            assert pool.rank_of(layer, module).tolist() == [0, 8]
            pool.lora_a(layer, module)[0].fill_(1e3)
            pool.lora_b(layer, module)[0].fill_(1e3)
    tokens = random_tokens([8, 6], seed=19)
    scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, [0, 1], strict=True)])
    scenario.run([5, 6], [1, 0])
    _check(scenario, [attention_only[0], with_experts[0]], base=build_tiny_model(spec))


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_rank_columns_past_a_modules_own_rank_are_not_read(tiny_model_dirs, monkeypatch, kernels):
    """Adapters whose attention modules have ranks below their adapter's (rank_pattern) and
    below the pool's, garbage in every linear module's pool columns past the module's own
    rank, and a mixed batch of prefill and decode steps: each module's kernels read its own
    rank (the per-segment ranks the step gathers for each module instance), so the
    logprobs stay peft's."""
    if kernels == "triton":
        _route_through_triton(monkeypatch, "auto")
    spec = "v3_q_lora"
    runner = make_runner(tiny_model_dirs[spec], spec, num_slots=3, max_rank=16)
    cases = [
        peft_case(spec, rank=8, seed=22, rank_pattern={"o_proj": 2, "kv_b_proj": 3, "q_a_proj": 5}),
        peft_case(spec, rank=4, seed=23, target_parameters=None, rank_pattern={"q_b_proj": 1}),
    ]
    for slot, (_, adapter) in zip((0, 2), cases, strict=True):
        runner.lora_pool.load(slot, adapter)
    pool = runner.lora_pool
    below_adapter_rank = 0
    for layer, module in pool.module_instances():
        if module.startswith("moe."):
            continue
        a, b = pool.lora_a(layer, module), pool.lora_b(layer, module)  # [S, n·R, in], [S, out, R]
        for slot, (_, adapter) in zip((0, 2), cases, strict=True):
            rank = int(pool.rank_of(layer, module)[slot])
            below_adapter_rank += 0 < rank < adapter.manifest.rank
            b[slot, :, rank:] = 1e3
            for first in range(0, a.shape[1], pool.max_rank):  # each stacked slice
                a[slot, first + rank : first + pool.max_rank] = 1e3
    assert below_adapter_rank >= 4
    tokens = random_tokens([7, 6, 5], seed=24)
    scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, [0, -1, 2], strict=True)])
    scenario.run([4, 6, 2], [1, 0, 3])
    base = build_tiny_model(spec)
    _check(scenario, [cases[0][0], base, cases[1][0]], base=base)
