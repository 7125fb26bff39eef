"""The sm_90 compile check of `make test`: the launch recorder (tests/fixtures/launch_record.py)
and tools/sm90_compile.py, which compiles the recorded launches with the real compiler in a
process without TRITON_INTERPRET. A kernel the interpreter runs and the compiler refuses
must fail it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from kernels import fused_moe as fm
from tests.fixtures.launch_record import record_launches
from tools.sm90_compile import read_launches

ROOT = Path(__file__).resolve().parents[2]


def _compile(
    folder: Path, *args: str, pythonpath: Path | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    tool = str(ROOT / "tools" / "sm90_compile.py")
    return subprocess.run(
        [sys.executable, tool, str(folder), "--jobs", "1", *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip


def test_recorded_launch_compiles_for_sm90(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A launch through `fast` is recorded with its types, constexprs and alignment, and
    the tool compiles it once for two launches that differ only in alignment, plus its
    bf16 twin."""
    from kernels import launch

    monkeypatch.setattr(launch.FastLaunch, "_launch", launch.FastLaunch._launch)
    record_launches(tmp_path)
    fm.silu_mul(torch.randn(3, 64, dtype=torch.float16))
    fm.silu_mul(torch.randn(3 * 64 + 1, dtype=torch.float16)[1:].view(3, 64))  # misaligned
    lines = [
        json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.read_text().splitlines()
    ]
    assert [line["kernel"] for line in lines] == ["_silu_mul_kernel"] * 2
    assert lines[0]["args"]["x_ptr"] == ["tensor", "fp16", True]
    assert lines[1]["args"]["x_ptr"] == ["tensor", "fp16", False]
    assert lines[0]["args"]["BLOCK"] == ["value", 32]
    distinct = read_launches(tmp_path, "kernels.")  # one kind, most aligned, and as bf16
    assert [launch["args"]["x_ptr"] for launch in distinct] == [
        ["tensor", "bf16", True],
        ["tensor", "fp16", True],
    ]
    done = _compile(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 of 2 launches of 1 kernels compile" in done.stdout


def test_a_kernel_only_the_interpreter_accepts_fails(tmp_path: Path) -> None:
    """A plain global read inside a kernel: the interpreter runs it, the compiler does not."""
    package = tmp_path / "broken_kernels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "plain_global.py").write_text(
        textwrap.dedent("""
        import triton
        import triton.language as tl

        LIMIT = 2**30  # not a tl.constexpr

        @triton.jit
        def _kernel(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n, other=0)
            tl.store(x_ptr + offs, tl.minimum(x, LIMIT), mask=offs < n)
    """)
    )
    launch = {
        "module": "broken_kernels.plain_global", "kernel": "_kernel",
        "args": {"x_ptr": ["tensor", "i32", True], "n": ["value", 7], "BLOCK": ["value", 16]},
        "constexprs": ["BLOCK"], "options": {},
    }  # fmt: skip
    logs = tmp_path / "launches"
    logs.mkdir()
    (logs / "launches-1.jsonl").write_text(json.dumps(launch) + "\n")
    done = _compile(logs, "--package", "broken_kernels.", pythonpath=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED broken_kernels.plain_global._kernel" in done.stdout
    assert "LIMIT" in done.stdout
