"""`make demo` end to end: the script brings the stack up, uploads the shipped adapters,
prints generations side by side; the stack it leaves running serves every adapter with
output of its own; a second run reuses it; `--down` stops it and removes its state."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from adapter_store.client import StoreClient
from protos import inference_pb2 as pb
from protos import inference_pb2_grpc
from tools.demo_stack import BASE_MODEL, STACK_FILE, load
from tools.stack import REPO_ROOT

ADAPTERS = ("docs-prose", "shouty", "unittest-style")
PROMPT = "import os\nimport sys\n\nclass "


def run_demo(state_dir: Path, *args: str, env: dict[str, str] | None = None):
    return subprocess.run(
        [sys.executable, "-m", "tools.demo", "--state-dir", str(state_dir), *args],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "160", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def greedy(stub: inference_pb2_grpc.InferenceStub, adapter: str) -> list[int]:
    request = pb.GenerateRequest(
        adapter=adapter,
        prompt=PROMPT,
        sampling=pb.SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
    )
    return [t for message in stub.Generate(request, timeout=120) for t in message.token_ids]


async def stored_adapters(address: str):
    async with StoreClient(address) as store:
        return await store.list_adapters(base_model=BASE_MODEL)


@pytest.fixture
def state_dir(tmp_path: Path):
    state = tmp_path / "demo-state"
    yield state
    # `--down` removes the state directory, logs included (services', Redis's, SeaweedFS's):
    # print their tails first, so a failure's report ("Captured stdout teardown") says what
    # each server saw.
    for log in sorted(state.rglob("*.log")) if state.exists() else []:
        lines = log.read_text(errors="replace").splitlines()
        print(f"--- {log.name} (last 40 of {len(lines)} lines)", *lines[-40:], sep="\n")
    if state.exists():  # a failed test must not leave servers behind
        run_demo(state, "--down")


def test_demo_end_to_end(state_dir: Path) -> None:
    import asyncio

    first = run_demo(state_dir, "--prompts", "1", "--max-new-tokens", "8")
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    stack = json.loads((state_dir / STACK_FILE).read_text())
    inference = f"127.0.0.1:{stack['inference']['port']}"
    store = f"127.0.0.1:{stack['store']['port']}"
    header = next(line for line in out.splitlines() if line.startswith("base model"))
    assert [cell.strip() for cell in header.split("│")] == ["base model", *ADAPTERS]
    assert out.count("TTFT ") == 4
    assert "prompt 'def read_config(path):\\n'" in out
    assert f"--store {store} list" in out
    assert f"{inference} loraserve.v1.Inference/Generate" in out
    assert "Stop it: " in out and "--down --state-dir" in out
    for name in ADAPTERS:
        assert re.search(rf"{name} +\[#{{30}}\] 100\.0%", first.stderr), first.stderr

    # The shipped adapters went in cleanly: version 1, rank 8, MLA and expert modules.
    adapters = {a.name: a for a in asyncio.run(stored_adapters(store))}
    assert sorted(adapters) == list(ADAPTERS)
    for adapter in adapters.values():
        assert (adapter.version, adapter.rank) == (1, 8)
        assert {"attn.qkv_a", "attn.kv_b", "moe.gate_up", "moe.down"} <= set(adapter.target_modules)
    # The loractl commands it prints work as printed.
    printed = [line.strip() for line in out.splitlines() if f"--store {store} " in line]
    assert [line.split(f"--store {store} ")[1].split()[0] for line in printed] == [
        "list",
        "get",
        "generate",
        "upload",
    ]
    for line in printed[:3]:
        ran = subprocess.run(
            ["bash", "-c", line],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.strip()
    # The stack left running serves them, each with greedy output of its own.
    with grpc.insecure_channel(inference) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        outputs = {name: tuple(greedy(stub, name)) for name in ("", *ADAPTERS)}
    assert all(len(tokens) == 12 for tokens in outputs.values())
    assert len(set(outputs.values())) == 4, outputs

    second = run_demo(state_dir, "--prompts", "1", "--max-new-tokens", "4")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "reusing the stack that is already running" in second.stdout
    assert second.stdout.count("already in the store (version 1)") == 3

    running = load(state_dir)
    down = run_demo(state_dir, "--down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped the demo stack" in down.stdout
    assert not state_dir.exists()
    assert all(server.process.poll() is not None for _, server in running.started())
    assert "no demo stack is running" in run_demo(state_dir, "--down").stdout


def test_missing_redis_is_explained(state_dir: Path) -> None:
    result = run_demo(state_dir, env={"PATH": "/nonexistent"})
    assert result.returncode == 1
    assert "redis-server is not installed: sudo apt-get install redis-server" in result.stderr
    assert not state_dir.exists()
