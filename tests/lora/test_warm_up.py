"""Start-up warm-up: which prefill sizes it runs, that every one of its steps is a valid
batch the runner executes (with and without LoRA, with a decode in front), and that it
leaves the pool and later results untouched."""

from __future__ import annotations

from inference_svc.engine.batch import build_batch
from inference_svc.engine.warm_up import (
    decode_counts,
    prefill_token_counts,
    warm_up_prefill,
    warm_up_sequences,
    warm_up_shapes,
)
from tests.fixtures.slot_checks import assert_slot_empty
from tests.lora.harness import (
    TOL,
    Scenario,
    Seq,
    make_runner,
    max_logprob_diff,
    oracle_logprobs,
    peft_case,
    random_tokens,
)


def test_token_counts_cover_every_power_of_two_of_tokens_and_of_pairs() -> None:
    # Powers of two up to 64, and ceil(2^j / 6) for the pair counts T·6 up to 384.
    assert prefill_token_counts(64, 6) == [1, 2, 3, 4, 6, 8, 11, 16, 22, 32, 43, 64]
    assert prefill_token_counts(100, 1) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_decode_counts_cover_one_small_and_each_power_of_two_class() -> None:
    assert decode_counts(40) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33]
    assert decode_counts(2) == [1, 2]


def test_mixed_steps_have_page_tables_as_wide_as_their_decode_contexts() -> None:
    # The paged decode kernel is specialised on the table's row stride: the warm-up's
    # decode rows must give real widths (3: generic class, 16: multiple of 16), not 1.
    for width in (3, 16):
        steps, pages_used = warm_up_sequences(21, 10, 4, decodes=5, width=width, lora_slot=-1)
        batch = build_batch(steps, 4, "cpu")
        assert batch.page_table.shape[1] == width
        assert batch.num_decode_seqs == 5 and batch.num_tokens == 21
        assert pages_used == width + 3 + 2  # shared decode pages, prompts of 10 and 6


def test_warm_up_steps_run_and_leave_the_pool_and_results_untouched(tiny_model_dirs) -> None:
    spec = "v3_q_lora"
    runner = make_runner(tiny_model_dirs[spec], spec, num_slots=2, max_rank=8)
    shapes = warm_up_shapes(24, 6, runner.model.config.routing.top_k)
    # Mixed: 16 prompt tokens beside decodes whose page tables are 3 and 16 pages wide.
    assert {(21, 5, 3), (21, 5, 16), (20, 4, 3), (20, 4, 16)} <= set(shapes)
    # Every shape without and with LoRA.
    assert warm_up_prefill(runner, 24, 10, max_decodes=6) == 2 * len(shapes)
    assert_slot_empty(runner.lora_pool, 0)
    peft_model, adapter = peft_case(spec, rank=4, seed=31)
    runner.lora_pool.load(0, adapter)
    tokens = random_tokens([9, 7], seed=32)
    scenario = Scenario(runner, [Seq(t, slot) for t, slot in zip(tokens, [0, -1], strict=True)])
    scenario.run([9, 7])
    assert max_logprob_diff(scenario.seqs[0], oracle_logprobs(peft_model, tokens[0])) <= TOL


def test_long_lora_steps_warm_both_moe_lora_placements(tiny_model_dirs, monkeypatch) -> None:
    """Steps of more pairs than PAIRS_MAX_PAIRS run with LoRA twice: the routed experts'
    expand in the grouped GEMM's epilogue and after it (serving picks per step)."""
    from inference_svc.engine import warm_up
    from inference_svc.layers import moe
    from inference_svc.lora import apply

    monkeypatch.setattr(warm_up, "PAIRS_MAX_PAIRS", 40)
    calls = {"in_gemm": 0, "after": 0}

    def counting(name, fn):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(moe, "start_moe_lora", counting("in_gemm", moe.start_moe_lora))
    monkeypatch.setattr(moe, "add_moe_gate_up", counting("after", moe.add_moe_gate_up))
    spec = "v3_q_lora"
    runner = make_runner(tiny_model_dirs[spec], spec, num_slots=2, max_rank=8)
    top_k = runner.model.config.routing.top_k
    shapes = warm_up_shapes(24, 1, top_k)
    long = sum(tokens * top_k > 40 for tokens, _, _ in shapes)
    assert 0 < long < len(shapes)
    assert warm_up_prefill(runner, 24, 10) == 2 * len(shapes) + long
    assert calls["in_gemm"] > 0 and calls["after"] > 0
    assert apply.MOE_LORA_IN_GEMM == "auto"  # the forced placements were undone
