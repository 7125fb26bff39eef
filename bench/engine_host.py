"""The engine's own host time per decode step, with the model run stubbed out (CPU).

A serving decode step is GPU work plus host work (scheduling, the batch layout, launching,
reading the previous step's tokens back and emitting their outputs). Steps overlap
(engine.py), so the GPU waits for the host only when a step's whole host time exceeds its
GPU time: `median_ms` is the figure to hold against the GPU step. This times
`LLMEngine.step()` on the embedded tiny model with `ModelRunner.execute` replaced by a stub
that returns zero logits of the right shape, so what is left is the engine's Python and
numpy work: the part that would stay on the critical path at any model size. The stub's
logits cover only the first STUB_VOCAB token ids, so the sampler's arithmetic (device work
in serving) stays small; compare figures of one machine, not with GPU steps. 128 requests
decode together, without adapters and with the three shipped adapters (LoRA segments in
every batch). `critical_median_ms` leaves out the outputs' flush (what the GPU waited for
before the overlap, kept for comparison with earlier figures).
Host-only: run it on the CPU machine; figures are machine-relative, compare them within one
run or one machine.

    python -m bench.engine_host --out /tmp/engine_host.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.gpu_timing import device_name, run_meta, write_json
from inference_svc.adapters.embedded_source import (
    EMBEDDED_ADAPTERS,
    EmbeddedAdapterSource,
    embedded_binding,
)
from inference_svc.engine.batch import BatchMetadata
from inference_svc.engine.sequence import GenerationParams, Sequence
from inference_svc.runtime import Runtime, RuntimeConfig, build_runtime

STUB_VOCAB = 8


def stub_runtime(sequences: int) -> Runtime:
    config = RuntimeConfig(
        model="tiny", base_model_name="tiny", max_loras=4, max_num_seqs=sequences,
        max_batch_tokens=max(512, 16 * sequences), cuda_graphs=False, warm_up=False,
    )  # fmt: skip
    runtime = build_runtime(config, None)
    runtime.residency.source = EmbeddedAdapterSource(runtime.hf_config)

    def no_model(input_ids: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        # Logits over the first few token ids only: the sampler's arithmetic over a whole
        # vocabulary is device work in serving and would dominate this host-only figure.
        return torch.zeros(batch.logits_indices.shape[0], STUB_VOCAB)

    runtime.engine.runner.execute = no_model  # type: ignore[method-assign]
    return runtime


def decode_step_ms(
    runtime: Runtime, sequences: int, new_tokens: int, adapters: bool
) -> tuple[list[float], list[float]]:
    """Wall ms of each decode-only step while `sequences` requests run together, and of
    the part of it outside `_flush_outputs` (the outputs of the step before)."""
    engine, tokenizer = runtime.engine, runtime.tokenizer
    flush = engine._flush_outputs
    flushed = [0.0]

    def timed_flush() -> None:
        began = time.perf_counter()
        flush()
        flushed[0] += time.perf_counter() - began

    engine._flush_outputs = timed_flush  # type: ignore[method-assign]

    def submit(request_id: str, index: int, max_new_tokens: int) -> None:
        seq = Sequence(
            request_id,
            tokenizer.encode(f"request {index}: the quick brown fox"),
            GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True),
            tokenizer,
            (),
            None,
            sink=lambda output: None,
        )
        if adapters:
            seq.adapter = embedded_binding(EMBEDDED_ADAPTERS[index % len(EMBEDDED_ADAPTERS)])
        engine.add_request(seq)

    if adapters:  # one request per adapter first, so every adapter is in a slot
        for i in range(len(EMBEDDED_ADAPTERS)):
            submit(f"warm-{i}", i, 1)
        while engine.has_work():
            if engine.step() == 0:
                time.sleep(0.001)  # adapters being normalized and loaded
    for i in range(sequences):
        submit(f"{'lora' if adapters else 'base'}-{i}", i, new_tokens)
    samples, critical = [], []
    while engine.has_work():
        flushed[0] = 0.0
        started = time.perf_counter()
        tokens = engine.step()
        elapsed = (time.perf_counter() - started) * 1e3
        if tokens == engine.scheduler.num_running == sequences:
            samples.append(elapsed)  # every request decoding, none admitted or finished
            critical.append(elapsed - flushed[0] * 1e3)
    return samples, critical


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (median)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    # A first pass is slower (lazy imports and first-call caches): run one, discard it.
    decode_step_ms(stub_runtime(args.sequences), args.sequences, 4, adapters=True)
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.repeats):  # interleaved, so drift hits both cases alike
        for adapters in runs:
            runtime = stub_runtime(args.sequences)
            steps, critical = decode_step_ms(runtime, args.sequences, args.new_tokens, adapters)
            runs[adapters].append((statistics.median(steps), statistics.median(critical)))
    rows = []
    for adapters, medians in runs.items():
        row = {
            "adapters": len(EMBEDDED_ADAPTERS) if adapters else 0,
            "sequences": args.sequences,
            "repeats": args.repeats,
            "median_ms": statistics.median(total for total, _ in medians),
            "critical_median_ms": statistics.median(part for _, part in medians),
        }
        rows.append(row)
        print(
            f"{'LoRA' if adapters else 'base':4s} {args.sequences} sequences: host "
            f"{row['median_ms']:.3f} ms per decode step, "
            f"{row['critical_median_ms']:.3f} ms outside the outputs' flush"
        )
    meta = run_meta(
        "engine_host", torch.device("cpu"), started, host=device_name(torch.device("cpu"))
    )
    write_json(args.out, meta, rows)


if __name__ == "__main__":
    main()
