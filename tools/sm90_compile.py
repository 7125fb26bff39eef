"""Compile for sm_90, without a GPU, every distinct Triton launch a CPU test run recorded.

CPU tests run the kernels in Triton's interpreter, which accepts code the GPU compiler
refuses: a plain global read inside a kernel, a loop-carried tile that one of the
compiler's passes cannot lay out. Both reached the GPU machine in one session before this
check existed. `tests/conftest.py` records each interpreted launch when
LORASERVE_LAUNCH_LOG names a folder (`tests/fixtures/launch_record.py`); this compiles
every distinct (kernel, constexprs, argument types, 16-byte divisibility, options) of the
record for sm_90 and fails naming each launch that does not compile.

    LORASERVE_LAUNCH_LOG=/tmp/launches python -m pytest tests/kernels
    python tools/sm90_compile.py /tmp/launches
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any


def read_launches(folder: Path, package: str) -> list[dict[str, Any]]:
    """The distinct recorded launches of every log file in `folder`, in a stable order,
    each launch with fp16 tensors also as bf16 (the GPU's dtype, which the interpreter
    mishandles, so the CPU tests stand in fp16 for it).

    Launches that differ only in alignment (tensor addresses, values of non-constexpr
    integers) count as one, the most aligned kept, as a GPU launch would mostly be: the
    interpreter's failures to catch depend on the constexprs and types (a `make test` run
    records thousands of launches, a few hundred distinct so).
    """
    chosen: dict[str, tuple[int, str]] = {}
    for log in sorted(folder.glob("*.jsonl")):
        for recorded in log.read_text().splitlines():
            launch = json.loads(recorded)
            if not launch["module"].startswith(package):
                continue  # e.g. a test's own kernel (tests/kernels/test_launch.py)
            for variant in (launch, _as_bf16(launch)):
                line = json.dumps(variant)
                key = _kind(variant)
                aligned = sum(_aligned(a) for a in variant["args"].values())
                if key not in chosen or (aligned, line) > chosen[key]:
                    chosen[key] = (aligned, line)
    return [json.loads(chosen[key][1]) for key in sorted(chosen)]


def _kind(launch: dict[str, Any]) -> str:
    """What launches that differ only in alignment share: every constexpr's value, the
    other arguments' types."""
    constexprs = set(launch["constexprs"])
    args = {
        name: arg[1] if name in constexprs else _shape_free(arg)
        for name, arg in launch["args"].items()
    }
    return json.dumps([launch["module"], launch["kernel"], launch["options"], args])


def _as_bf16(launch: dict[str, Any]) -> dict[str, Any]:
    """`launch` with its fp16 tensors bf16 (the same launch when it has none)."""
    args = {
        name: ["tensor", "bf16", *arg[2:]] if arg[:2] == ["tensor", "fp16"] else arg
        for name, arg in launch["args"].items()
    }
    return {**launch, "args": args}


def _shape_free(arg: list[Any]) -> Any:
    """A non-constexpr argument without what only alignment decides: a tensor's element
    type, a number's type (an integer 1 as itself: Triton makes it a constant); strings,
    bools and None as they are."""
    kind, value, *_ = arg
    if kind == "tensor" or value == 1 and type(value) is int:
        return value
    return value if value is None or isinstance(value, str | bool) else type(value).__name__


def _aligned(arg: list[Any]) -> bool:
    kind, value, *rest = arg
    if kind == "tensor":
        return bool(rest[0])
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def compile_args(fn: Any, launch: dict[str, Any]) -> tuple[dict, dict, list[str]]:
    """(signature, constexprs, div16) of a recorded launch, by `fn`'s parameters: what
    Triton's own launch would specialise (a None argument, and an integer 1 where the
    parameter is specialised, become constants: unit strides, say)."""
    signature, constexprs, div16 = {}, {}, []
    for param in fn.params:
        kind, *rest = launch["args"][param.name]
        unit = kind == "value" and type(rest[0]) is int and rest[0] == 1
        if param.is_constexpr or rest[0] is None or (unit and not param.do_not_specialize):
            constexprs[param.name] = rest[0]
        elif kind == "tensor":
            element, aligned = rest
            signature[param.name] = f"*{element}"
            if aligned:
                div16.append(param.name)
        else:
            signature[param.name], divisible = _scalar_type(rest[0])
            if divisible and not param.do_not_specialize:
                div16.append(param.name)
    return signature, constexprs, div16


def _scalar_type(value: Any) -> tuple[str, bool]:
    if isinstance(value, bool):
        return "i1", False
    if isinstance(value, int):
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"a non-constexpr argument {value!r} has no Triton scalar type")


def compile_launch(launch: dict[str, Any]) -> str | None:
    """None when the launch compiles for sm_90, else the compiler's message."""
    from tools.sm90 import compile_sm90

    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    try:
        compile_sm90(fn, *compile_args(fn, launch), launch["options"])
    except Exception as error:  # every compiler failure is reported, none is fatal here
        return f"{type(error).__name__}: {error}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path, help="LORASERVE_LAUNCH_LOG of the test run")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--package", default="kernels.", help="compile the kernels of modules with this prefix"
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("needs the real compiler: run it without TRITON_INTERPRET=1")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    launches = read_launches(args.folder, args.package)
    if not launches:
        # A test selection without kernel launches (PYTEST_ARGS) has nothing to compile.
        print(f"sm90_compile: no launches of {args.package}* recorded in {args.folder}")
        return 0
    started = time.monotonic()
    with ProcessPoolExecutor(args.jobs) as pool:
        errors = list(pool.map(compile_launch, launches))
    failed = [(launch, error) for launch, error in zip(launches, errors, strict=True) if error]
    for launch, error in failed:
        print(f"FAILED {launch['module']}.{launch['kernel']} {json.dumps(launch)}\n  {error}")
    kernels = len({(launch["module"], launch["kernel"]) for launch in launches})
    print(
        f"sm90_compile: {len(launches) - len(failed)} of {len(launches)} launches of {kernels} "
        f"kernels compile for sm_90 ({time.monotonic() - started:.0f} s)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
