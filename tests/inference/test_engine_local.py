"""The engine alone (no store, Redis or S3: adapters normalized from the embedded PEFT
folders in memory) against transformers+peft in float32, by KL per token over the full
distribution: float32 on the CPU (tight), bfloat16 on the GPU (KL ≤ 1e-3), and the CUDA-graph
decode path giving the same tokens as eager. Imports only torch/transformers/peft, so it
runs on the GPU machine."""

from __future__ import annotations

import time

import pytest
import torch

from inference_svc.adapters.embedded_source import (
    EMBEDDED_ADAPTERS,
    EmbeddedAdapterSource,
    embedded_binding,
)
from inference_svc.engine.sampling import SamplingParams
from inference_svc.engine.sequence import GenerationParams, Sequence
from inference_svc.runtime import Runtime, RuntimeConfig, build_runtime
from tests.inference.bf16_replay import (
    Schedule,
    StepShare,
    assert_replay_parity,
    check_replay_against_peft,
    replay,
)
from tests.inference.client import PROMPTS, load_peft_oracle

ADAPTERS = EMBEDDED_ADAPTERS
NEW_TOKENS = 12
binding = embedded_binding


def make_runtime(device: str, dtype: str, cuda_graphs: bool = False) -> Runtime:
    config = RuntimeConfig(
        model="tiny", base_model_name="tiny", device=device, dtype=dtype, max_loras=4,
        kv_pages=128, max_num_seqs=8, cuda_graphs=cuda_graphs,
    )  # fmt: skip
    runtime = build_runtime(config, None)
    runtime.residency.source = EmbeddedAdapterSource(runtime.hf_config)
    return runtime


def run(
    runtime: Runtime, cases: list[tuple[str, str]]
) -> tuple[list[Sequence], dict[str, list[torch.Tensor]], Schedule]:
    """Run all cases at once (greedy, prompt logprobs); returns the sequences, per request
    every logits row the model produced for it in position order, and each step's batch
    composition."""
    engine, tokenizer = runtime.engine, runtime.tokenizer
    rows: dict[str, list[torch.Tensor]] = {}
    steps: Schedule = []
    execute = engine.runner.execute

    def recording(input_ids, batch):
        logits = execute(input_ids, batch)
        spans = engine._row_spans(pending)  # the rows the engine will read
        for s, (first, end) in zip(pending, spans, strict=True):
            rows.setdefault(s.seq.request_id, []).append(logits[first:end].float().cpu())
        steps.append([StepShare(s.seq.request_id, s.query_len, s.all_logits) for s in pending])
        return logits

    seqs = []
    for i, (adapter, prompt) in enumerate(cases):
        params = GenerationParams(max_new_tokens=NEW_TOKENS, prompt_logprobs=True, ignore_eos=True)
        seq = Sequence(f"r{i}", tokenizer.encode(prompt), params, tokenizer, (), None)
        seq.adapter = binding(adapter) if adapter else None
        engine.add_request(seq)
        seqs.append(seq)
    original_schedule = engine.scheduler.schedule

    def schedule():
        nonlocal pending
        out = original_schedule()
        pending = out.scheduled
        return out

    pending = []
    engine.scheduler.schedule = schedule
    engine.runner.execute = recording
    try:
        deadline = time.monotonic() + 300
        while engine.has_work():
            if engine.step() == 0:
                time.sleep(0.005)  # adapters streaming in
            assert time.monotonic() < deadline
    finally:
        engine.scheduler.schedule = original_schedule
        engine.runner.execute = execute
    return seqs, rows, steps


@torch.no_grad()
def max_kl_per_token(oracle, seq: Sequence, rows: list[torch.Tensor]) -> float:
    """max over positions of KL(oracle ‖ ours), on the sequence our engine generated."""
    adapter = "" if seq.adapter is None else seq.adapter.name
    ids = seq.prompt_token_ids + seq.output_token_ids
    if adapter:
        oracle.set_adapter(adapter)
        expected = oracle(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    else:
        with oracle.disable_adapter():
            expected = oracle(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    ours = torch.cat(rows).log_softmax(-1)  # [positions, V]: prompt rows, then decodes
    expected = expected[: ours.shape[0]]
    kl = (expected.exp() * (expected - ours)).sum(-1)
    return kl.max().item()


CASES = [("", PROMPTS[0]), *((a, PROMPTS[i]) for i, a in enumerate(ADAPTERS, 1))]


@pytest.fixture(scope="module")
def oracle():
    return load_peft_oracle(ADAPTERS)


def test_float32_cpu_engine_matches_peft(oracle) -> None:
    seqs, rows, _ = run(make_runtime("cpu", "float32"), CASES)
    for seq in seqs:
        assert len(seq.output_token_ids) == NEW_TOKENS
        assert max_kl_per_token(oracle, seq, rows[seq.request_id]) < 1e-6


def replay_on_fresh_runtime(device: str, seqs: list[Sequence], schedule: Schedule) -> tuple:
    """The engine's schedule on a second runtime of the same config (its own pool, with
    the adapters loaded by hand into slots of our choosing): rows and router inputs."""
    runtime = make_runtime(device, "bfloat16", cuda_graphs=device == "cuda")
    runner = runtime.engine.runner
    slots = {name: slot for slot, name in enumerate(ADAPTERS)}
    for name, slot in slots.items():
        runner.lora_pool.load(slot, runtime.residency.source.fetch(binding(name))).wait_on()
    graphed = replay(runner, seqs, schedule, slots)  # the engine's dispatch (graphs on CUDA)
    if device == "cuda":  # hooks do not fire in graph replays: record eagerly
        runner.release_decode_graphs()
        return runner, graphed, replay(runner, seqs, schedule, slots)
    return runner, graphed, graphed


# Same batch composition, same kernels: the CPU gives the engine's rows bit for bit. On the
# GPU the LoRA kernels split K with fp32 atomics (summation order varies run to run), so a
# row may differ in its last bits: 1e-2 abs logprob is ~100x that and far below what a
# wrong token, position, page or slot does (> 0.1 on these adapters).
ENGINE_VS_RUNNER_TOL = {"cpu": 0.0, "cuda": 1e-2}
BF16_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", BF16_DEVICES)
def test_bfloat16_engine_equals_runner_and_peft_up_to_near_ties(oracle, device) -> None:
    """(a) The engine adds no error: its rows equal the runner's on the same batch
    composition. (b) The runner's bf16 rows meet KL ≤ 1e-3 against the peft fp32 oracle
    routed as we were at near-tie flips, in the rounding-robust form of
    `assert_replay_parity` (tests/inference/bf16_replay.py)."""
    seqs, rows, schedule = run(make_runtime(device, "bfloat16", cuda_graphs=True), CASES * 2)
    runner, same_dispatch, eager = replay_on_fresh_runtime(device, seqs, schedule)
    for seq in seqs:
        engine_rows = torch.cat(rows[seq.request_id]).log_softmax(-1)
        ours = same_dispatch.rows[seq.request_id].log_softmax(-1)
        diff = (engine_rows - ours).abs().max().item()
        assert diff <= ENGINE_VS_RUNNER_TOL[device], (seq.request_id, diff)
    routing = runner.model.layers[-1].moe.gate.routing
    assert_replay_parity(check_replay_against_peft(eager, seqs, runner, oracle, routing))


@pytest.mark.gpu
def test_cuda_graph_decode_gives_eager_tokens() -> None:
    """Same requests, same tokens. Every adapter is made resident first: otherwise which
    requests share a step depends on when each adapter's slot load finishes, and bf16 rows
    batched differently may differ by an ulp and flip an exact tie (seen on an H200: r11's
    logits 9.25 / 9.25 in one run, 9.3125 / 9.25 in the other)."""
    cases = CASES * 3
    outputs = []
    for cuda_graphs in (False, True):
        runtime = make_runtime("cuda", "bfloat16", cuda_graphs=cuda_graphs)
        run(runtime, [(adapter, "warm up") for adapter in ADAPTERS])
        outputs.append(run(runtime, cases)[0])
    eager, graphed = outputs
    for a, b in zip(eager, graphed, strict=True):
        assert a.output_token_ids == b.output_token_ids, a.request_id


@pytest.mark.gpu
def test_a_step_is_launched_without_waiting_for_the_device() -> None:
    """Steps overlap only if laying out and launching one never waits for the GPU (a sync
    would wait for the step before it): with torch's sync debug mode at "error", any
    synchronizing call in a launch — prefill and graphed decode steps, adapters, greedy and
    seeded sampling — raises. Only the read-back of the launched step may sync."""
    runtime = make_runtime("cuda", "bfloat16", cuda_graphs=True)
    engine, tokenizer = runtime.engine, runtime.tokenizer
    seqs = []
    for i, (adapter, prompt) in enumerate(CASES * 2):
        sampling = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=i) if i % 2 else None
        params = GenerationParams(
            max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling=sampling or SamplingParams()
        )
        seq = Sequence(f"s{i}", tokenizer.encode(prompt), params, tokenizer, (), None)
        seq.adapter = binding(adapter) if adapter else None
        engine.add_request(seq)
        seqs.append(seq)
    launch = engine._launch
    launches = 0

    def strict_launch(scheduled):  # type: ignore[no-untyped-def]
        nonlocal launches
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = launch(scheduled)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        launches += 1
        return launched

    engine._launch = strict_launch
    deadline = time.monotonic() + 300
    while engine.has_work():
        if engine.step() == 0:
            time.sleep(0.005)  # adapters streaming in
        assert time.monotonic() < deadline
    assert launches >= NEW_TOKENS
    assert all(len(s.output_token_ids) == NEW_TOKENS for s in seqs)
