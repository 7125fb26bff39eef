"""The serving benchmarks' whole setup and measuring path at tiny shapes on the CPU
(`--smoke`), and the summary table reading what they wrote: the GPU run must not be the
first time this code runs."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from bench import queued_cold_adapter, serve_cold_path, serve_offline, serve_online, summary
from bench.serve_setup import ServeBenchConfig, add_engine_args, build_engine


def test_serve_offline_smoke(tmp_path: Path) -> None:
    out = tmp_path / "serve_offline_r16.json"
    serve_offline.main(["--out", str(out), "--smoke"])
    results = json.loads(out.read_text())
    rows = {row["scenario"]: row for row in results["rows"]}
    assert set(rows) == {"no LoRA", "N=8 zipf", "N=2 uniform"}
    for row in rows.values():
        assert row["valid"], row
        assert row["output_tokens"] == row["requests"] * results["meta"]["output_len"]
    # More adapters than the 2 slots: they cycled host cache → slots.
    assert rows["N=8 zipf"]["distinct_used"] > results["meta"]["gpu_slots"]
    assert rows["N=8 zipf"]["slot_loads"] >= rows["N=8 zipf"]["distinct_used"]
    assert rows["no LoRA"]["slot_loads"] == 0
    assert rows["N=2 uniform"]["slot_loads"] >= 2  # every scenario starts with cold slots
    assert results["ratios"]["vs_no_lora"]["N=8 zipf"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
    meta = results["meta"]
    assert meta["command"] == f"python3 -m bench.serve_offline --out {out} --smoke"
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", meta["revision"])


def test_serve_offline_resident_adapters_start_in_slots(tmp_path: Path) -> None:
    """`--resident`: a scenario whose adapters fit the 2 slots loads none while timed (they
    were loaded before its clock started); with more names than slots the rest still cycle."""
    out = tmp_path / "serve_offline_resident.json"
    serve_offline.main(["--out", str(out), "--smoke", "--resident"])
    results = json.loads(out.read_text())
    assert results["meta"]["resident"] is True
    rows = {row["scenario"]: row for row in results["rows"]}
    for row in rows.values():
        assert row["valid"] and row["resident"], row
        assert row["output_tokens"] == row["requests"] * results["meta"]["output_len"]
    assert rows["N=2 uniform"]["distinct_used"] == 2
    assert rows["N=2 uniform"]["slot_loads"] == 0
    assert rows["N=8 zipf"]["slot_loads"] > 0


def test_serve_offline_rounds_take_each_scenarios_median(tmp_path: Path) -> None:
    """`--rounds 3`: every scenario three times, round after round; the ratios divide the
    medians, and the ranges hold each scenario's lowest and highest throughput."""
    out = tmp_path / "serve_offline_rounds.json"
    serve_offline.main(["--out", str(out), "--smoke", "--rounds", "3"])
    results = json.loads(out.read_text())
    assert results["meta"]["rounds"] == 3
    rows = results["rows"]
    assert [row["round"] for row in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [row["scenario"] for row in rows[:3]] == [row["scenario"] for row in rows[3:6]]
    tok_s = {}
    for row in rows:
        assert row["valid"], row
        tok_s.setdefault(row["scenario"], []).append(row["output_tokens_per_s"])
    medians = {label: sorted(values)[1] for label, values in tok_s.items()}
    expected = medians["N=8 zipf"] / medians["no LoRA"]
    assert results["ratios"]["vs_no_lora"]["N=8 zipf"] == pytest.approx(expected)
    for label, values in tok_s.items():
        assert results["ratios"]["tokens_per_s_range"][label] == [min(values), max(values)]


def test_serve_offline_rejects_zero_rounds() -> None:
    with pytest.raises(SystemExit):
        serve_offline.main(["--out", "/dev/null", "--smoke", "--rounds", "0"])


def test_serve_offline_smoke_with_moe_lora_in_the_gemm(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`--moe-lora-in-gemm always`: every step's routed-expert LoRA goes through the grouped
    GEMM's epilogue (on the CPU: its reference) inside the serving engine."""
    from inference_svc.lora import apply

    monkeypatch.setattr(apply, "MOE_LORA_IN_GEMM", apply.MOE_LORA_IN_GEMM)  # restored after
    out = tmp_path / "serve_offline_in_gemm.json"
    serve_offline.main(["--out", str(out), "--smoke", "--moe-lora-in-gemm", "always"])
    results = json.loads(out.read_text())
    assert results["meta"]["moe_lora_in_gemm"] == "always"
    assert apply.MOE_LORA_IN_GEMM == "always"
    for row in results["rows"]:
        assert row["valid"], row
        assert row["output_tokens"] == row["requests"] * results["meta"]["output_len"]


def test_serve_offline_timeline(tmp_path: Path) -> None:
    """`--timeline`: every engine step call, in order; the ones that ran tokens add up to
    the row's steps and tokens, and the slot loads they started to the row's loads."""
    out = tmp_path / "serve_offline_timeline.json"
    serve_offline.main(["--out", str(out), "--smoke", "--timeline"])
    results = json.loads(out.read_text())
    for row in results["rows"]:
        entries = row["timeline"]
        assert [e["at_s"] for e in entries] == sorted(e["at_s"] for e in entries)
        ran = [e for e in entries if e["tokens"] > 0]
        assert len(ran) == row["steps"]
        prompts = row["requests"] * results["meta"]["prompt_len"]
        assert sum(e["tokens"] for e in ran) == prompts + row["output_tokens"] - row["requests"]
        assert sum(e["loads_started"] for e in entries) == row["slot_loads"]
        assert entries[-1]["running"] == entries[-1]["waiting"] == 0
        assert all(e["loads_in_flight"] >= 0 and e["seconds"] > 0 for e in entries)
        # The launch and the read-back are parts of the step call's wall time.
        assert all(0 <= e["launch_s"] + e["read_back_s"] <= e["seconds"] for e in entries)
        assert all(e["launch_s"] > 0 for e in ran) and any(e["read_back_s"] > 0 for e in ran)
        assert all(e[name] >= 0 for e in entries for name in serve_offline.ALLOCATOR_COUNTS)
    zipf = next(row for row in results["rows"] if row["scenario"] == "N=8 zipf")
    assert max(e["adapters_running"] for e in zipf["timeline"]) >= 2


def test_serve_offline_profile_windows(tmp_path: Path) -> None:
    out = tmp_path / "serve_offline_profile.json"
    serve_offline.main(["--out", str(out), "--smoke", "--profile-steps", "2"])
    rows = {row["scenario"]: row for row in json.loads(out.read_text())["rows"]}
    windows = {label: row["profile"] for label, row in rows.items()}
    for label, profile in windows.items():
        assert profile, label  # the smoke runs reach the first window (step 4) only
        for window in profile.values():
            assert window["steps"] == 2 and window["wall_us_per_step"] > 0
            assert window["launches_per_step"] > 0 and window["classes"]
    # On the CPU the records are top-level aten ops: the LoRA steps issue more of them.
    launches = {
        label: max(w["launches_per_step"] for w in profile.values())
        for label, profile in windows.items()
    }
    assert launches["N=8 zipf"] > launches["no LoRA"]


def test_serve_offline_host_profile_windows(tmp_path: Path) -> None:
    out = tmp_path / "serve_offline_host_profile.json"
    serve_offline.main(
        ["--out", str(out), "--smoke", "--profile-steps", "2", "--profile-kind", "host"]
    )
    rows = {row["scenario"]: row for row in json.loads(out.read_text())["rows"]}
    for label, row in rows.items():
        assert row["profile"], label
        for window in row["profile"].values():
            assert window["steps"] == 2 and window["wall_us_per_step"] > 0
            # The engine step itself is among our functions, and nothing it calls can take
            # longer than it does.
            ours = window["ours_by_total_time"]
            step = next(v for k, v in ours.items() if k.endswith(" step") and "engine.py" in k)
            assert step["calls_per_step"] == 1.0
            assert all(v["total_ms_per_step"] <= step["total_ms_per_step"] for v in ours.values())
            assert window["by_self_time"]
            # The step's direct callees include the model run's launch.
            step_callees = next(v for k, v in window["callees"].items() if k.endswith(" step"))
            assert any(k.endswith(" _launch") for k in step_callees), step_callees


def test_serve_offline_profile_windows_start_where_asked(tmp_path: Path) -> None:
    out = tmp_path / "serve_offline_profile_from.json"
    serve_offline.main(
        ["--out", str(out), "--smoke", "--profile-steps", "1", "--profile-from", "0", "2"]
    )
    for row in json.loads(out.read_text())["rows"]:
        windows = row["profile"]
        # Step 0 is every scenario's first prefill; step 2 comes after it.
        assert len(windows) == 2, (row["scenario"], list(windows))
        assert all(window["steps"] == 1 for window in windows.values())
        assert any("prefill" in label for label in windows)


def test_serve_online_smoke(tmp_path: Path) -> None:
    out = tmp_path / "serve_online.json"
    serve_online.main(["--out", str(out), "--smoke"])
    results = json.loads(out.read_text())
    assert {(run["mode"], run["rate"]) for run in results["runs"]} == {
        ("base", 2.0),
        ("lora", 2.0),
    }
    for run in results["runs"]:
        assert run["completed"] == run["requests"] and run["failed"] == 0
    cold = results["cold"]
    assert cold["probes_failed"] == 0
    for kind in ("warm", "host-cold", "file-cold"):
        assert cold["ttft"][kind]["n"] == 1 and cold["ttft"][kind]["p50_ms"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_serve_online_cycling_adapters_run(tmp_path: Path) -> None:
    """`--cycling-adapters`: a third run a rate over adapters in no slot at its start; more
    of them than the slots the pinned ones leave, so each distinct one is copied in."""
    out = tmp_path / "serve_online_cycling.json"
    argv = ["--out", str(out), "--smoke", "--cycling-adapters", "40", "--duration", "8"]
    serve_online.main([*argv, "--no-breadth-first-admission"])
    results = json.loads(out.read_text())
    assert results["meta"]["cycling_adapters"] == 40
    assert results["meta"]["breadth_first_admission"] is False
    runs = {run["mode"]: run for run in results["runs"]}
    assert set(runs) == {"base", "lora", "cycling"}
    cycling = runs["cycling"]
    assert cycling["completed"] == cycling["requests"] > 0 and cycling["failed"] == 0
    assert cycling["distinct_adapters"] > results["meta"]["gpu_slots"] - results["meta"]["adapters"]
    assert cycling["slot_loads"] >= cycling["distinct_adapters"]
    assert runs["lora"]["slot_loads"] == 0  # pinned before the runs
    assert out.with_suffix(".png").stat().st_size > 0


def test_serve_online_cold_probes_on_an_idle_engine(tmp_path: Path) -> None:
    out = tmp_path / "serve_online_idle.json"
    serve_online.main(["--out", str(out), "--smoke", "--rates", "--cold-rate", "0"])
    results = json.loads(out.read_text())
    assert results["runs"] == []
    cold = results["cold"]
    assert cold["rate"] == 0 and cold["probes_failed"] == 0
    for kind in ("warm", "host-cold", "file-cold"):
        assert cold["ttft"][kind]["n"] == 1 and cold["ttft"][kind]["p50_ms"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_serve_cold_path_smoke(tmp_path: Path) -> None:
    out = tmp_path / "cold.json"
    serve_cold_path.main(["--out", str(out), "--smoke"])
    results = json.loads(out.read_text())
    assert set(results["stats"]) == {
        "s3 x8", "s3 x8 whole", "s3 x16", "s3 x16 whole", "store FetchAdapter",
    }  # fmt: skip
    for stats in results["stats"].values():
        assert stats["n"] == 2 and stats["p50_ms"] > 0
    table = summary.render(summary.lines(tmp_path, out, tmp_path / "no_floor.json"))
    assert "store FetchAdapter → host" in table
    assert "not run" in table  # no GPU results in this folder: shown as such, never made up


def test_serve_cold_path_without_the_routed_experts(tmp_path: Path) -> None:
    """`--no-routed` stores and fetches the adapter most MoE fine-tunes are: every module
    but the routed experts'."""
    from bench.store_throughput import v2_lite_peft_folder

    out = tmp_path / "cold.json"
    serve_cold_path.main(["--out", str(out), "--smoke", "--no-routed", "--concurrency", "8"])
    results = json.loads(out.read_text())
    assert "every module but the routed experts" in results["adapter"]
    config = serve_cold_path.SMOKE_CONFIG
    without = v2_lite_peft_folder(tmp_path / "without", config, routed=False)
    assert results["peft_bytes"] == without < v2_lite_peft_folder(tmp_path / "with", config)
    assert all(stats["n"] == 2 for stats in results["stats"].values())


def test_queued_cold_adapter_smoke(tmp_path: Path) -> None:
    """Both arms run against the real stack; the scheduler's look-ahead is restored after."""
    from inference_svc.engine.scheduler import Scheduler

    look_ahead = Scheduler._load_ahead
    out = tmp_path / "queued.json"
    queued_cold_adapter.main(["--out", str(out), "--smoke", "--run-steps", "20"])
    results = json.loads(out.read_text())
    for arm in ("look-ahead", "without"):
        assert len(results["after_seat_s"][arm]) == 2
        waits = zip(results["after_seat_s"][arm], results["from_arrival_s"][arm], strict=True)
        assert all(0 < after_seat <= from_arrival for after_seat, from_arrival in waits)
    assert Scheduler._load_ahead is look_ahead
    assert out.with_suffix(".png").stat().st_size > 0
    table = summary.render(summary.lines(tmp_path, tmp_path / "none.json", tmp_path, out))
    p50 = results["stats"]["look-ahead after_seat_s"]["p50_ms"]
    row = f"queued request, after its seat, p50 (ms) ≤ 100 {p50:.3g} yes"
    assert row in " ".join(table.split())


@pytest.mark.parametrize("flags,slots", [([], 64), (["--max-loras", "128"], 128)])
def test_engine_flags_size_the_slot_pool(flags: list[str], slots: int) -> None:
    """`--max-loras` reaches the GPU run's engine config (the smoke run keeps its 2 slots)."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--out", "x.json", *flags])
    config = ServeBenchConfig.from_args(args, smoke_max_batch_tokens=64, smoke_max_loras=2)
    assert config.max_loras == slots


def test_serve_offline_smoke_without_breadth_first_admission(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`--no-breadth-first-admission` reaches the engine's scheduler and the JSON's meta, and
    every request still runs to its end."""
    engines = []

    def build(*args):  # type: ignore[no-untyped-def]
        engines.append(build_engine(*args))
        return engines[-1]

    monkeypatch.setattr(serve_offline, "build_engine", build)
    out = tmp_path / "serve_offline_no_breadth.json"
    serve_offline.main(["--out", str(out), "--smoke", "--no-breadth-first-admission"])
    results = json.loads(out.read_text())
    assert results["meta"]["breadth_first_admission"] is False
    assert engines[0].scheduler.config.breadth_first_admission is False
    for row in results["rows"]:
        assert row["valid"], row
        assert row["output_tokens"] == row["requests"] * results["meta"]["output_len"]


@pytest.mark.parametrize("flags,expected", [([], True), (["--no-breadth-first-admission"], False)])
def test_breadth_first_admission_flag_reaches_the_engine_config(
    flags: list[str], expected: bool
) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--out", "x.json", *flags])
    config = ServeBenchConfig.from_args(args, smoke_max_batch_tokens=64, smoke_max_loras=2)
    assert config.breadth_first_admission is expected
