"""The rounding modes of `tests.inference.bf16_roundings` round what they say (the figures
of `bf16_spread --rounding` in docs/kernel_notes.md rest on them), and leave the runtime as
it was once closed."""

from __future__ import annotations

import torch

from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.runtime import Runtime
from tests.inference.bf16_roundings import bf16, rounded, runtime_dtype
from tests.inference.test_engine_local import make_runtime

PROMPT = torch.tensor([5, 17, 99, 3, 42, 7, 250])


def prefill(runtime: Runtime) -> torch.Tensor:
    """One prefill of PROMPT on a fresh cache: the float32 logits rows."""
    runner = runtime.engine.runner
    runner.kv_cache.pools.zero_()
    step = SequenceStep(0, len(PROMPT), (0, 1), all_logits=True, lora_slot=-1)
    batch = build_batch([step], 16, runner.device, runner.lora_slot_rank)
    return runner.execute(PROMPT, batch).float()


def written_cache_rows(runtime: Runtime) -> torch.Tensor:
    pools = runtime.engine.runner.kv_cache.pools
    return pools[pools.ne(0).any(-1)]  # [rows, C + R] the rows the prefill wrote


def test_bf16_cache_mode_writes_bf16_values_into_its_float32_cache() -> None:
    runtime = make_runtime("cpu", runtime_dtype("bf16-inputs-and-cache"))
    plain = prefill(runtime)
    rows = written_cache_rows(runtime)
    assert rows.dtype == torch.float32 and len(rows) >= len(PROMPT)
    assert not torch.equal(rows, bf16(rows))  # float32 values as the runtime computes them
    with rounded(runtime, "bf16-inputs-and-cache"):
        rounded_logits = prefill(runtime)
        rows = written_cache_rows(runtime)
        assert torch.equal(rows, bf16(rows))
    assert not torch.equal(rounded_logits, plain)
    assert torch.equal(prefill(runtime), plain)  # closed: the runtime computes as before


def test_fp32_residual_mode_keeps_the_residual_stream_in_float32(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    runtime = make_runtime("cpu", runtime_dtype("fp32-residual"))
    residual_dtypes: list[torch.dtype] = []
    layer = runtime.engine.runner.model.layers[0]
    after_attention = layer.after_attention

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        h, pending = after_attention(*args, **kwargs)  # the layer's residual stream out
        residual_dtypes.append(h.dtype)
        return h, pending

    monkeypatch.setattr(layer, "after_attention", recorded)
    plain = prefill(runtime)
    with rounded(runtime, "fp32-residual"):
        kept = prefill(runtime)
    assert residual_dtypes == [torch.bfloat16, torch.float32]
    assert not torch.equal(kept, plain)


def test_gemm_inputs_mode_feeds_every_linear_bf16_values() -> None:
    runtime = make_runtime("cpu", runtime_dtype("bf16-gemm-inputs"))
    inputs: list[torch.Tensor] = []
    o_proj = runtime.engine.runner.model.layers[0].attn.o
    # Registered after the mode's own hook, so it sees the input the linear computes with.
    with rounded(runtime, "bf16-gemm-inputs"):
        handle = o_proj.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
        prefill(runtime)
        handle.remove()
    assert inputs[0].dtype == torch.float32 and torch.equal(inputs[0], bf16(inputs[0]))
