"""`bench.without_pdl` runs the named module as __main__ with PDL disabled."""

from __future__ import annotations

import sys

import pytest
import triton.language as tl

from bench import without_pdl
from kernels import pdl


def test_runs_the_module_with_its_arguments_and_pdl_off(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    target = tmp_path / "pdl_probe.py"
    target.write_text(
        "import sys\nfrom kernels import pdl\n"
        "if __name__ == '__main__':\n"
        "    print('probe', sys.argv[1:], pdl.enabled())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    # As on a Hopper GPU (the CPU has it off already); restored after the test.
    monkeypatch.setattr(pdl, "ENABLED", tl.constexpr(True))
    assert pdl.enabled()
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    printed = []
    monkeypatch.setattr("builtins.print", lambda *a: printed.append(a))
    without_pdl.main(["pdl_probe", "--x", "1"])
    assert printed == [("probe", ["--x", "1"], False)]


def test_without_a_module_it_says_how_to_call_it() -> None:
    with pytest.raises(SystemExit, match="usage"):
        without_pdl.main([])
