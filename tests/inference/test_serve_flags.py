"""`python -m inference_svc serve` flags reach the runtime config: the step overlap is on
by default and off with `--no-overlap-steps` or `LORASERVE_OVERLAP_STEPS=0`."""

from __future__ import annotations

import dataclasses

import pytest

# The service entry point imports the health service, absent on the GPU machine.
pytest.importorskip("grpc_health")
from inference_svc.__main__ import app_config, build_parser  # noqa: E402
from inference_svc.runtime import RuntimeConfig, build_runtime  # noqa: E402


def _runtime(argv: list[str]):  # type: ignore[no-untyped-def]
    return app_config(build_parser().parse_args(["serve", *argv])).runtime


def test_overlap_is_on_by_default_and_the_flag_turns_it_off() -> None:
    assert _runtime([]).overlap_steps is True
    assert _runtime(["--no-overlap-steps"]).overlap_steps is False
    assert _runtime(["--overlap-steps"]).overlap_steps is True


def test_breadth_first_admission_is_on_by_default_and_reaches_the_scheduler(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    assert _runtime([]).breadth_first_admission is True
    assert _runtime(["--no-breadth-first-admission"]).breadth_first_admission is False
    monkeypatch.setenv("LORASERVE_BREADTH_FIRST_ADMISSION", "0")
    config = _runtime([])
    assert config.breadth_first_admission is False
    assert _runtime(["--breadth-first-admission"]).breadth_first_admission is True
    runtime = build_runtime(dataclasses.replace(config, kv_pages=16), None)
    assert runtime.engine.scheduler.config.breadth_first_admission is False


def test_expert_activations_flag_and_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    assert _runtime([]).expert_activations == "bf16"
    assert _runtime(["--expert-activations", "e4m3"]).expert_activations == "e4m3"
    monkeypatch.setenv("LORASERVE_EXPERT_ACTIVATIONS", "e4m3")
    assert _runtime([]).expert_activations == "e4m3"
    with pytest.raises(SystemExit):
        _runtime(["--expert-activations", "fp8"])
    with pytest.raises(ValueError, match="expert activations must be one of"):
        RuntimeConfig(model="tiny", base_model_name="tiny", expert_activations="fp8")


def test_lora_memory_budget_as_gigabytes_or_a_fraction() -> None:
    """The LoRA pool's budget reaches the runtime config either way, never both."""
    assert _runtime(["--lora-memory-gb", "3"]).lora_memory_gb == 3.0
    assert _runtime(["--lora-memory-fraction", "0.25"]).lora_memory_fraction == 0.25
    with pytest.raises(ValueError, match="not both"):
        _runtime(["--lora-memory-gb", "3", "--lora-memory-fraction", "0.25"])
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        _runtime(["--lora-memory-fraction", "1.5"])


@pytest.mark.parametrize("raw,expected", [("0", False), ("false", False), ("1", True)])
def test_the_environment_sets_the_default(monkeypatch, raw, expected) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("LORASERVE_OVERLAP_STEPS", raw)
    assert _runtime([]).overlap_steps is expected
    assert _runtime(["--overlap-steps"]).overlap_steps is True  # the command line wins


def test_the_fraction_sizes_the_runtimes_lora_pool() -> None:
    """RuntimeConfig.lora_memory_fraction reaches the pool: a fraction of free memory too
    small for one slot is the pool's start-up error, a usable one gives the capped slots."""
    base = {"model": "tiny", "base_model_name": "tiny", "max_loras": 3, "kv_pages": 16}
    with pytest.raises(ValueError, match="lora_memory_fraction=1e-12 .* holds no slot"):
        build_runtime(RuntimeConfig(**base, lora_memory_fraction=1e-12), None)
    runtime = build_runtime(RuntimeConfig(**base, lora_memory_fraction=0.5), None)
    assert runtime.engine.runner.lora_pool.num_slots == 3


def test_step_graph_max_tokens_flag_environment_and_sizes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The largest step graph reaches the runtime config; the runner's sizes stop at it (or
    at the step's token budget), and 0 captures none."""
    from inference_svc.runtime import step_graph_sizes

    assert _runtime([]).step_graph_max_tokens == 2048
    assert _runtime(["--step-graph-max-tokens", "0"]).step_graph_max_tokens == 0
    monkeypatch.setenv("LORASERVE_STEP_GRAPH_MAX_TOKENS", "640")
    assert _runtime([]).step_graph_max_tokens == 640
    with pytest.raises(ValueError, match="step_graph_max_tokens must be >= 0"):
        RuntimeConfig(model="tiny", base_model_name="tiny", step_graph_max_tokens=-1)
    assert step_graph_sizes(0) == ()
    assert step_graph_sizes(640) == (16, 32, 64, 128, 256, 384, 512, 640)
    assert step_graph_sizes(1500)[-4:] == (896, 1024, 1280, 1500)
    assert step_graph_sizes(20) == (16, 20)
