"""Compile one Triton kernel for sm_90 on a machine without a GPU and summarise its SASS.

Reads what costs no device time (HOPPER.md): registers, stack/spills, shared memory, and
which memory / matrix / fence instructions the kernel uses (16-byte LDG/LDGSTS or scalar
2-byte ones, REDG vs fenced ATOMG, HMMA vs HGMMA). Arguments the real launch would
specialise as divisible by 16 (aligned pointers, strides like 7168) must be named in
--div16, or the summary shows the scalar code of an unaligned launch.

    python tools/triton_sass.py kernels.sgmv _sgmv_expand_kernel \\
        --sig '{"y_ptr": "*fp32", ...}' --const '{"BLOCK_N": 128, ...}' \\
        --div16 y_ptr b_ptr ... --out /tmp/kc
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

_SASS_OPS = re.compile(
    r"\b((?:LDGSTS|LDG|STG|ATOMG|REDG|HGMMA|HMMA|MEMBAR|CCTL|LDL|STL|UTMALDG)[A-Z0-9._]*)"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("module")
    parser.add_argument("kernel")
    parser.add_argument("--sig", required=True, help="JSON: argument -> Triton type")
    parser.add_argument("--const", default="{}", help="JSON: constexpr argument -> value")
    parser.add_argument("--div16", nargs="*", default=[], help="arguments divisible by 16")
    parser.add_argument("--options", default="{}", help="JSON compile options (num_warps...)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kc"))
    args = parser.parse_args()

    sys.path.insert(0, str(Path.cwd()))
    import triton

    from tools.sm90 import compile_sm90

    fn = getattr(importlib.import_module(args.module), args.kernel)
    kernel = compile_sm90(
        fn, json.loads(args.sig), json.loads(args.const), args.div16, json.loads(args.options)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    cubin = args.out / f"{args.kernel}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    (args.out / f"{args.kernel}.ptx").write_text(kernel.asm["ptx"])
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    usage = subprocess.run(
        [tools / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True
    ).stdout
    sass = subprocess.run([tools / "nvdisasm", "-c", cubin], capture_output=True, text=True).stdout
    (args.out / f"{args.kernel}.sass").write_text(sass)
    resources = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", usage)
    meta = kernel.metadata
    print(args.kernel, resources and resources.group(0), f"warps {meta.num_warps}")
    print("  ", dict(collections.Counter(_SASS_OPS.findall(sass))))


if __name__ == "__main__":
    main()
