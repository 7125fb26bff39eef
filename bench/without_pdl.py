"""Run another benchmark module with programmatic dependent launch off: the A side of a
PDL A/B on one tree (`kernels.pdl.disable()` before any kernel compiles).

    python3 -m bench.without_pdl bench.model_decode --json … --plot … --batch-sizes 1 64 256
"""

from __future__ import annotations

import runpy
import sys

from kernels import pdl


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit("usage: python3 -m bench.without_pdl MODULE [ARGS ...]")
    pdl.disable()
    sys.argv = [args[0], *args[1:]]
    runpy.run_module(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
