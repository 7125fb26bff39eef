"""GPU: CUDA-graph decode replays with LoRA equal to eager steps. Run with `pytest -m gpu
tests/lora`. The bf16-vs-peft-fp32 KL checks live in test_bf16_precision.py (cpu and cuda)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.fp8_checkpoints import FP8_CONFIG, copy_with, fp8_tensors
from tests.fixtures.tiny_models import build_tiny_model
from tests.lora.harness import (
    Scenario,
    Seq,
    assert_runners_agree,
    make_runner,
    max_logprob_diff,
    oracle_logprobs,
    peft_case,
    random_tokens,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SPEC = "v3_q_lora"
# How much further from the oracle the one-token gemv path may be than the cuBLAS path, in
# float32 on the GPU: a reduction order's worth, well below an adapter's effect (> 0.05).
GPU_FP32_SLACK = 1e-3


def _adapted_runner(folder, dtype, cuda_graph_sizes=()):
    """A CUDA runner (graphs captured while the pool is still empty) with two adapters."""
    runner = make_runner(
        folder, SPEC, num_slots=4, max_rank=16, device="cuda", dtype=dtype,
        cuda_graph_sizes=cuda_graph_sizes,
    )  # fmt: skip
    cases = [peft_case(SPEC, rank=4, seed=21), peft_case(SPEC, rank=16, seed=22)]
    for slot, (_, adapter) in zip((3, 1), cases, strict=True):
        runner.lora_pool.load(slot, adapter).wait_on()
    return runner, [peft_model for peft_model, _ in cases]


def _count_calls(monkeypatch, *targets):  # type: ignore[no-untyped-def]
    """Wrap each (module, function name) so that the returned dict counts its calls by name
    (the tests clear it between runs)."""
    calls: dict[str, int] = {}

    def counted(name, launcher):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] = calls.get(name, 0) + 1
            return launcher(*args, **kwargs)

        return run

    for module, name in targets:
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    return calls


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_cuda_graph_decode_replay_with_lora_equals_eager(tiny_model_dirs, dtype, tol):
    """Five sequences (two adapters and the base) decode through graphs captured for 1, 2,
    4 and 8 rows (5 padded to 8; the capture saw an empty pool and no adapter), then fewer
    as they end."""
    folder = tiny_model_dirs[SPEC]
    eager, _ = _adapted_runner(folder, dtype)
    graphed, _ = _adapted_runner(folder, dtype, cuda_graph_sizes=(1, 2, 4, 8))
    replays = []
    replay = graphed._replay

    def counted_replay(graph, input_ids, batch):
        replays.append(graph.size)
        return replay(graph, input_ids, batch)

    graphed._replay = counted_replay
    tokens = random_tokens([9, 12, 7, 10, 11], seed=24)
    slots = [1, 1, -1, 3, 1]
    runs = []
    for runner in (eager, graphed):
        scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, slots, strict=True)])
        scenario.run([4, 5, 3, 6, 2])
        runs.append(scenario.seqs)
    assert 8 in replays and 2 in replays, replays
    for eager_seq, graph_seq in zip(*runs, strict=True):
        diff = (torch.stack(eager_seq.logprobs) - torch.stack(graph_seq.logprobs)).abs().max()
        assert diff.item() <= tol, f"slot {eager_seq.slot}: graph vs eager {diff.item():.2e}"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_steps_without_routed_expert_adapters_replay_their_own_graph(tiny_model_dirs, dtype, tol):
    """Decode steps none of whose adapters targets the routed experts replay the graph
    captured without the MoE LoRA (LoraScope.NOT_ROUTED), the others the full LoRA graph;
    both equal eager steps. The adapter on the experts (slot 1) ends first."""
    from inference_svc.lora.batch import LoraScope

    runners = []
    for sizes in ((), (1, 2, 4, 8)):
        runner = make_runner(
            tiny_model_dirs[SPEC], SPEC, num_slots=4, max_rank=16, device="cuda", dtype=dtype,
            cuda_graph_sizes=sizes,
        )  # fmt: skip
        _, attention_only = peft_case(SPEC, rank=8, seed=26, target_parameters=None)
        _, with_experts = peft_case(SPEC, rank=4, seed=27)
        runner.lora_pool.load(2, attention_only).wait_on()
        runner.lora_pool.load(1, with_experts).wait_on()
        runners.append(runner)
    eager, graphed = runners
    scopes = []
    replay = graphed._replay

    def recorded(graph, input_ids, batch):  # type: ignore[no-untyped-def]
        scopes.append(LoraScope.of(graph.batch.lora))
        return replay(graph, input_ids, batch)

    graphed._replay = recorded
    tokens = random_tokens([9, 12, 7, 10], seed=28)
    slots = [2, -1, 1, 2]
    runs = []
    for runner in (eager, graphed):
        scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, slots, strict=True)])
        scenario.run([4, 5, 3, 6])
        runs.append(scenario.seqs)
    assert LoraScope.ALL in scopes and LoraScope.NOT_ROUTED in scopes, scopes
    for eager_seq, graph_seq in zip(*runs, strict=True):
        diff = (torch.stack(eager_seq.logprobs) - torch.stack(graph_seq.logprobs)).abs().max()
        assert diff.item() <= tol, f"slot {eager_seq.slot}: graph vs eager {diff.item():.2e}"


@pytest.mark.parametrize("graphs", [(), (1, 2, 4, 8)], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, GPU_FP32_SLACK), (torch.bfloat16, 2e-2)])
def test_shrink_inside_the_product_equals_the_side_stream_shrink(
    tiny_model_dirs, monkeypatch, graphs, dtype, tol
):  # type: ignore[no-untyped-def]
    """Steps of at least the pool's 4 slots multiply the linears' input by their carriers
    (base weight and every slot's A rows: the shrink inside the product) and the expand
    reads each token's own slot's columns; with that path off they shrink on the side
    stream. The same logprobs, eager and in graph replays, up to a reduction order's worth
    in float32 (the two paths sum y in other orders)."""
    from inference_svc.layers import linear
    from inference_svc.lora import apply

    calls = _count_calls(monkeypatch, (linear, "product_with_lora"))
    tokens = random_tokens([9, 12, 7, 10, 11], seed=29)
    slots = [1, 1, -1, 3, 1]
    runs, carried = [], []
    for limit in (apply.SHRINK_IN_PRODUCT_MAX_TOKENS, 0):
        monkeypatch.setattr(apply, "SHRINK_IN_PRODUCT_MAX_TOKENS", limit)
        calls.clear()
        runner, _ = _adapted_runner(tiny_model_dirs[SPEC], dtype, cuda_graph_sizes=graphs)
        scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, slots, strict=True)])
        scenario.run([4, 5, 3, 6, 2])
        runs.append(scenario.seqs)
        carried.append(calls.get("product_with_lora", 0))
    assert carried[0] > 0 and carried[1] == 0, carried
    for inside, beside in zip(*runs, strict=True):
        diff = (torch.stack(inside.logprobs) - torch.stack(beside.logprobs)).abs().max()
        assert diff.item() <= tol, f"slot {inside.slot}: inside vs beside {diff.item():.2e}"


@pytest.mark.parametrize(
    "graphs,side",
    [((1, 2, 4, 8), "lora"), ((), "shared_experts"), ((1, 2, 4, 8), "shared_experts")],
    ids=["graphs-lora", "eager-shared_experts", "graphs-shared_experts"],
)
def test_side_streams_equal_the_same_kernels_in_order(tiny_model_dirs, monkeypatch, graphs, side):
    """Work forked onto a side stream (the default) computes exactly what the same kernels
    give on the step's own stream: the linear modules' shrinks in graph replays ("lora"; an
    eager step never forks them) and the shared experts' MLP beside the routed experts
    ("shared_experts"), eager and in replays. A missing join would read a half-written y or
    shared-expert output and show up here."""
    from inference_svc.layers import moe
    from inference_svc.layers.streams import shared_experts_stream
    from inference_svc.lora import apply
    from inference_svc.models import deepseek_v3

    serial = {
        "lora": (apply, "lora_side_stream", lambda device: None),
        "shared_experts": (deepseek_v3, "SHARED_EXPERTS_STREAM_MAX_TOKENS", 0),
    }[side]
    # Steps of the pool's 4 slots or more would take the linears' shrink inside the product.
    monkeypatch.setattr(apply, "SHRINK_IN_PRODUCT_MAX_TOKENS", 0)
    mlp_forward = moe.DenseMLP.forward
    mlp_streams = []

    def recorded(self, x, lora=None):  # type: ignore[no-untyped-def]
        mlp_streams.append(torch.cuda.current_stream(x.device))
        return mlp_forward(self, x, lora)

    monkeypatch.setattr(moe.DenseMLP, "forward", recorded)
    shared_stream = shared_experts_stream(torch.device("cuda"))
    tokens = random_tokens([9, 12, 7, 10, 11], seed=25)
    slots = [1, 1, -1, 3, 1]
    runs, forked = [], []
    for overlapped in (True, False):
        if not overlapped:
            monkeypatch.setattr(*serial)
        mlp_streams.clear()
        runner, _ = _adapted_runner(folder=tiny_model_dirs[SPEC], dtype=torch.bfloat16,
                                    cuda_graph_sizes=graphs)  # fmt: skip
        scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, slots, strict=True)])
        scenario.run([4, 5, 3, 6, 2])
        runs.append(scenario.seqs)
        forked.append(any(stream == shared_stream for stream in mlp_streams))
    assert forked == [True, side == "lora"], forked
    for overlapped, serial_seq in zip(*runs, strict=True):
        assert torch.equal(torch.stack(overlapped.logprobs), torch.stack(serial_seq.logprobs))


def test_linear_shrinks_fork_to_the_side_stream_only_while_a_graph_is_captured(
    tiny_model_dirs, monkeypatch
):
    """A replay pays the side stream's fork and join at capture only; an eager step would
    pay their host time every step, in every LoRA linear (`shrinks_beside_product`)."""
    from inference_svc.lora import apply

    calls = _count_calls(monkeypatch, (apply, "lora_side_stream"))
    runner, _ = _adapted_runner(
        folder=tiny_model_dirs[SPEC], dtype=torch.bfloat16, cuda_graph_sizes=(1, 2, 4, 8)
    )
    assert calls.get("lora_side_stream", 0) > 0, "the decode graphs' captures did not fork"
    calls.clear()
    tokens = random_tokens([9, 12, 7, 10, 11], seed=26)
    scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, [1, 3, -1, 1, 3], strict=True)])
    scenario.run([4, 5, 3, 6, 2])  # eager prompt and mixed steps, then decode replays
    assert not calls, f"eager steps forked their shrinks: {calls}"


def _assert_step_graphs_equal_eager(folder, dtype, tol, slots, scope, expert_activations="bf16"):
    """Prompt steps, mixed steps (decodes beside prompt chunks with cached context) and
    decode steps past the decode graphs replay the piecewise step graphs (sizes 16 / 32 /
    64; steps of 20, 10 and 3-5 tokens padded) with each layer's attention eager between
    the pieces; their logprobs equal an eager runner's. The graphs were captured while the
    pool was empty."""
    from inference_svc.lora.batch import LoraScope

    runners = []
    for step_sizes in ((), (16, 32, 64)):
        runner = make_runner(
            folder, SPEC, num_slots=4, max_rank=16, device="cuda", dtype=dtype,
            cuda_graph_sizes=(1, 2) if step_sizes else (), step_graph_sizes=step_sizes,
            expert_activations=expert_activations,
        )  # fmt: skip
        _, attention_only = peft_case(SPEC, rank=8, seed=26, target_parameters=None)
        for slot, case in ((1, peft_case(SPEC, rank=4, seed=27)[1]), (2, attention_only)):
            runner.lora_pool.load(slot, case).wait_on()
        runner.lora_pool.load(3, peft_case(SPEC, rank=16, seed=29)[1]).wait_on()
        runners.append(runner)
    eager, graphed = runners
    replays: list[tuple[int, LoraScope]] = []
    run = graphed.step_graphs.run

    def recorded(graph, input_ids, batch):  # type: ignore[no-untyped-def]
        replays.append((graph.size, LoraScope.of(graph.step.batch.lora)))
        return run(graph, input_ids, batch)

    graphed.step_graphs.run = recorded
    assert_runners_agree(eager, graphed, slots, seed=30, tol=tol)
    # 20 prompt tokens; 3 one-token rows + 7 prompt tokens with cached context; then decode
    # steps of 5, 4 and 3 rows (past the decode graphs of 1 and 2).
    assert (32, LoraScope(scope)) in replays and (16, LoraScope(scope)) in replays, replays


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "slots,scope",
    [([1, 1, -1, 3, 1], "all"), ([2, -1, 2, 2, -1], "not_routed"), ([-1] * 5, "none")],
)
def test_step_graphs_equal_eager_steps(tiny_model_dirs, dtype, tol, slots, scope):
    _assert_step_graphs_equal_eager(tiny_model_dirs[SPEC], dtype, tol, slots, scope)


@pytest.mark.parametrize("activations", ["bf16", "e4m3"])
def test_step_graphs_equal_eager_steps_on_fp8_experts(tiny_model_dirs, tmp_path, activations):
    """The same on FP8 block-quantized experts, whose grouped GEMMs take other tile plans
    and (e4m3 activations) quantize their inputs in the captured pieces."""
    folder = tiny_model_dirs[SPEC]
    quantized, _ = fp8_tensors(load_file(str(folder / "model.safetensors")))
    fp8_folder = copy_with(folder, tmp_path / "fp8", quantized, FP8_CONFIG)
    _assert_step_graphs_equal_eager(
        fp8_folder, torch.bfloat16, 2e-2, [1, 1, -1, 3, 2], "all", activations
    )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_moe_lora_in_the_gemm_epilogue_equals_the_kernels_after_it(
    tiny_model_dirs, monkeypatch, dtype, tol
):
    """In every MoE layer of a mixed run (prefill chunks, decodes, two adapters and the
    base), the routed experts' output with the LoRA expand in the grouped GEMM's epilogue
    (compiled) equals the "pairs" kernel after the GEMM on the same input, relative to the
    output's scale. (Not the end-to-end logprobs: these random adapters move activations
    by ~50, and a 1e-6 difference then flips routing near-ties in later layers.)"""
    from inference_svc.layers import moe
    from inference_svc.lora import apply

    forward = moe.MoE.forward
    diffs, effects = [], []

    def both_paths(self, x, lora=None, combine=True, x_float=None, routing=None):  # type: ignore[no-untyped-def]
        # Always combined: the decoder layer adds a tensor addend as it adds RoutedPairs.
        out = {}
        for where in ("always", "never"):
            monkeypatch.setattr(apply, "MOE_LORA_IN_GEMM", where)
            out[where] = forward(self, x, lora).float()
        if lora is not None:
            scale = out["never"].abs().max()
            diffs.append(((out["always"] - out["never"]).abs().max() / scale).item())
            effects.append(((out["never"] - forward(self, x).float()).abs().max() / scale).item())
        return out["never"].to(x.dtype)

    monkeypatch.setattr(moe.MoE, "forward", both_paths)
    runner, _ = _adapted_runner(tiny_model_dirs[SPEC], dtype)
    tokens = random_tokens([9, 12, 7, 10, 11], seed=26)
    slots = [1, 3, -1, 3, 1]
    Scenario(runner, [Seq(t, s) for t, s in zip(tokens, slots, strict=True)]).run([4, 5, 3, 6, 2])
    assert len(diffs) > 10 and max(effects) > 0.1  # the adapters act on the routed experts
    assert max(diffs) <= tol, f"epilogue vs after, relative: {max(diffs):.2e}"


@pytest.mark.parametrize("o_tile", [None, 256], ids=["kv_b_whole", "kv_b_u_in_pieces"])
@pytest.mark.parametrize("graphs", [(), (1,)], ids=["eager", "graphs"])
def test_one_token_lora_in_the_gemv_equals_peft(tiny_model_dirs, monkeypatch, graphs, o_tile):
    """A sequence decoding alone (one token a step) runs kernels.gemv with its LoRA: each
    linear's shrink as a GEMV and its expand in the product's epilogue, kv_b's corrections
    in the per-head products. Its float32 logprobs are as close to transformers+peft's as
    those of cuBLAS with the separate LoRA kernels (ONE_TOKEN_LORA_IN_GEMV False), for an
    adapter at the pool's rank (slot 1), one of rank 4 in the rank-16 pool (slot 3) and the
    base. Both sit ~3e-3 from the CPU oracle, the base model too (H100, fp32 CUDA kernels),
    while each adapter moves its logprobs by more than 0.05 (a lost delta shows).
    "kv_b_u_in_pieces": the o-side correction's u tile is over the GEMV's limit (as at pool
    rank 64) and is read after the wait in pieces; it still rides in the product."""
    from inference_svc.layers import linear, mla
    from inference_svc.lora import apply
    from kernels import gemv

    if o_tile is not None:  # the tiny model's q-side u tile is 16 × 16, its o-side 16 × 32
        monkeypatch.setattr(gemv, "LORA_TILE_ELEMENTS", o_tile)
        assert gemv._u_chunk(32, 16) == 16

    calls = _count_calls(
        monkeypatch,
        (linear, "one_token_linear_lora"),
        (mla, "one_token_kv_b_lora"),
        (mla, "set_kv_b_absorbed_q"),
        (mla, "add_kv_b_absorbed_o"),
        (apply, "finish_q_b_lora_with_kv_b_q"),
    )
    tokens = random_tokens([9, 8, 7], seed=27)
    diffs, calls_by_run = {}, {}
    for fused in (True, False):
        monkeypatch.setattr(apply, "ONE_TOKEN_LORA_IN_GEMV", fused)
        calls.clear()
        runner, peft_models = _adapted_runner(tiny_model_dirs[SPEC], torch.float32, graphs)
        oracles = {1: peft_models[1], 3: peft_models[0], -1: build_tiny_model(SPEC)}
        for seq_tokens, slot in zip(tokens, (1, 3, -1), strict=True):
            scenario = Scenario(runner, [Seq(seq_tokens, slot)])
            scenario.run([5])
            expected = oracle_logprobs(oracles[slot], seq_tokens)
            diffs[fused, slot] = max_logprob_diff(scenario.seqs[0], expected)
            if slot >= 0 and fused:
                base = oracle_logprobs(oracles[-1], seq_tokens)
                assert (expected - base).abs().max() > 0.05
        calls_by_run[fused] = dict(calls)
    fused_calls, separate_calls = calls_by_run[True], calls_by_run[False]
    assert fused_calls.get("one_token_linear_lora", 0) > 0, fused_calls
    assert fused_calls.get("set_kv_b_absorbed_q", 0) == 0, fused_calls  # the q side in the GEMV
    assert fused_calls.get("add_kv_b_absorbed_o", 0) == 0, fused_calls  # the o side too
    assert fused_calls.get("finish_q_b_lora_with_kv_b_q", 0) == 0, fused_calls
    assert "one_token_linear_lora" not in separate_calls, separate_calls
    # cuBLAS's q_b leaves its expand to the launch that also sets kv_b's query correction.
    assert separate_calls.get("finish_q_b_lora_with_kv_b_q", 0) > 0, separate_calls
    assert separate_calls.get("set_kv_b_absorbed_q", 0) == 0, separate_calls
    report = ", ".join(
        f"{'gemv' if f else 'cuBLAS'} slot {s}: {d:.1e}" for (f, s), d in diffs.items()
    )
    for slot in (1, 3, -1):
        assert diffs[True, slot] <= diffs[False, slot] + GPU_FP32_SLACK, report


@pytest.mark.parametrize("graphs", [(), (1, 2, 4, 8)], ids=["eager", "graphs"])
def test_kv_b_output_correction_in_the_merge_equals_peft(tiny_model_dirs, monkeypatch, graphs):
    """Decode steps of several sequences run the attention's split merge, which writes
    kv_b's output correction before W_UV's product is added onto it
    (`apply.KV_B_O_IN_MERGE`). In float32, each sequence's logprobs are as close to its
    transformers+peft model's as with the correction's own launch after the product, for
    an adapter at the pool's rank, one of rank 4 in the rank-16 pool and the base; steps
    of one token keep the GEMV path (neither)."""
    from inference_svc.layers import mla
    from inference_svc.lora import apply

    calls = _count_calls(
        monkeypatch, (mla, "add_kv_b_absorbed_o"), (apply, "kv_b_absorbed_o_in_merge")
    )
    tokens = random_tokens([9, 12, 7, 10, 11], seed=28)
    slots = [1, 1, -1, 3, 1]
    diffs, calls_by_run = {}, {}
    for in_merge in (True, False):
        monkeypatch.setattr(apply, "KV_B_O_IN_MERGE", in_merge)
        calls.clear()
        runner, peft_models = _adapted_runner(tiny_model_dirs[SPEC], torch.float32, graphs)
        oracles = {1: peft_models[1], 3: peft_models[0], -1: build_tiny_model(SPEC)}
        scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, slots, strict=True)])
        scenario.run([4, 5, 3, 6, 2])
        for i, (seq, slot) in enumerate(zip(scenario.seqs, slots, strict=True)):
            diffs[in_merge, i] = max_logprob_diff(seq, oracle_logprobs(oracles[slot], tokens[i]))
        calls_by_run[in_merge] = dict(calls)
    merged, separate = calls_by_run[True], calls_by_run[False]
    assert merged.get("kv_b_absorbed_o_in_merge", 0) > 0, merged
    assert merged.get("add_kv_b_absorbed_o", 0) == 0, merged
    assert separate.get("kv_b_absorbed_o_in_merge", 0) == 0, separate
    assert separate.get("add_kv_b_absorbed_o", 0) > 0, separate
    report = ", ".join(
        f"{'merge' if m else 'own launch'} seq {i}: {d:.1e}" for (m, i), d in diffs.items()
    )
    for i in range(len(slots)):
        assert diffs[True, i] <= diffs[False, i] + GPU_FP32_SLACK, report
