"""Compile a Triton kernel for sm_90 (Hopper) on a machine without a GPU.

Shared by `tools/triton_sass.py` (one kernel's SASS) and `tools/sm90_compile.py` (every
launch a CPU test run recorded). Needs the real compiler, so TRITON_INTERPRET must be off
in the calling process.
"""

from __future__ import annotations

from typing import Any

SM90 = ("cuda", 90, 32)


def compile_sm90(
    fn: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    div16: list[str],
    options: dict[str, Any],
) -> Any:
    """triton.compile of JITFunction `fn` for sm_90: `signature` maps the non-constexpr
    parameters to Triton types ("*bf16", "i32", ...), `div16` names the arguments the
    launch specialises as divisible by 16, `options` are launch options (num_warps...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in div16}
    source = ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*SM90), options=options)
