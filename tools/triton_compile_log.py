"""Run a module and log every Triton compile: kernel, constants, launch options and argument
attributes (the 16-byte divisibility Triton specialises pointers and integers by).

A compile while serving means a step met a specialisation the warm-up had not; comparing
its line with the warm-up's lines shows which argument differed.

    python tools/triton_compile_log.py --log compiles.txt bench.serve_offline --rank 16 ...
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

import triton.runtime.jit as jit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, required=True, help="one line per compile")
    parser.add_argument("module", help="run as __main__, with the arguments that follow")
    args, rest = parser.parse_known_args()
    log = args.log.open("w")
    started = time.monotonic()
    compile_kernel = jit.JITFunction._do_compile

    def logged(self, key, signature, device, constexprs, options, attrs, warmup):  # type: ignore[no-untyped-def]
        opts = {k: getattr(options, k, None) for k in ("num_stages", "num_warps")}
        print(
            f"COMPILE t={time.monotonic() - started:.1f} {self.fn.__name__} const={constexprs} "
            f"opts={opts} sig={signature} attrs={attrs}",
            file=log,
            flush=True,
        )
        return compile_kernel(self, key, signature, device, constexprs, options, attrs, warmup)

    jit.JITFunction._do_compile = logged
    sys.path.insert(0, str(Path.cwd()))
    sys.argv = [args.module, *rest]
    runpy.run_module(args.module, run_name="__main__")


if __name__ == "__main__":
    main()
