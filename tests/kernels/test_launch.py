"""`kernels.launch`: the key that picks a remembered compiled kernel never merges two argument
sets Triton would launch differently, and a remembered launch computes what Triton's does.

The key is plain host logic (CPU tests); the launches themselves need compiled kernels
(`gpu` tests: on the CPU every kernel is interpreted and FastLaunch passes calls through).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kernels.launch import FastLaunch, launch_key
from kernels.pdl import grid_dependency_control


@triton.jit(do_not_specialize=["n_loose"])
def _scale_kernel(x_ptr, out_ptr, n, n_loose, scale, BLOCK: tl.constexpr, ADD_ONE: tl.constexpr):
    """out[i] = x[i] · scale (+ 1) for i < min(n, n_loose)."""
    grid_dependency_control()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < n) & (offs < n_loose)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = x * scale
    if ADD_ONE:
        y = y + 1.0
    tl.store(out_ptr + offs, y, mask=mask)


# Kernels allowed statements before the wait, and how many: they only read what no kernel of
# a step writes (model weights, LoRA pool weights and ranks, the step's segment metadata),
# or what kernels before the previous one wrote, which that kernel's own wait made complete
# before this one could launch.
PREFETCH_BEFORE_WAIT = {
    "_gemv_kernel": 11,
    "_moe_lora_pair_kernel": 22,
    "_mla_absorbed_lora_prefetch_kernel": 2,
    "_sgmv_expand_kernel": 3,
}


def test_every_kernel_waits_for_its_predecessor_first() -> None:
    """Launches may overlap the previous kernel (kernels.pdl), which is safe only if each
    kernel's first statement waits for that kernel's writes."""
    kernels_dir = Path(__file__).parents[2] / "kernels"
    checked = []
    for path in sorted(kernels_dir.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            jit = any("triton.jit" in ast.unparse(d) for d in getattr(node, "decorator_list", []))
            if not (isinstance(node, ast.FunctionDef) and jit and node.name.endswith("_kernel")):
                continue
            body = node.body
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            if node.name in PREFETCH_BEFORE_WAIT:
                body = body[PREFETCH_BEFORE_WAIT[node.name] :]
            assert ast.unparse(body[0]) == "grid_dependency_control()", f"{path.name}:{node.name}"
            checked.append(node.name)
    assert len(checked) >= 28, checked


def _key(*values: object, loose: frozenset[int] = frozenset()) -> tuple[object, ...]:
    return launch_key(values, loose)


def test_tensors_are_keyed_by_dtype_and_16_byte_alignment_not_by_address() -> None:
    a, b = torch.zeros(64), torch.zeros(64)
    assert _key(a) == _key(b)
    assert _key(a) != _key(a.half())
    assert _key(a[1:]) != _key(a)  # 4 bytes in: Triton compiles without the alignment hint
    assert _key(a[4:]) == _key(a)  # 16 bytes in: aligned again
    assert _key(torch.nn.Parameter(a)) == _key(a)


def test_ints_are_keyed_by_value_and_loose_ints_by_width() -> None:
    assert _key(16) != _key(32) and _key(1) != _key(17)
    loose = frozenset({0})
    assert _key(16, loose=loose) == _key(17, loose=loose) == _key(1, loose=loose)
    assert _key(16, loose=loose) != _key(2**31, loose=loose) != _key(2**63, loose=loose)


def test_values_of_other_types_keep_their_type() -> None:
    # True == 1 == 1.0 in Python, but Triton launches each differently.
    assert len({_key(True), _key(1), _key(1.0)}) == 3
    assert _key("tf32") != _key("ieee") and _key(None) == _key(None)
    assert _key(tl.float16) != _key(tl.bfloat16)


@pytest.mark.gpu
def test_missing_arguments_are_refused_before_any_launch() -> None:
    launch = FastLaunch(_scale_kernel)
    x = torch.zeros(4, device="cuda")
    with pytest.raises(TypeError, match="must all be passed"):
        launch[(1,)](x, x, 4, 4, 1.0, BLOCK=16)
    with pytest.raises(TypeError, match="must all be passed"):
        launch[(1,)](x, x, 4, 4, 1.0, BLOCK=16, num_warps=2)


@pytest.mark.gpu
def test_launch_options_are_part_of_the_key() -> None:
    launch = FastLaunch(_scale_kernel)
    x = torch.randn(300, device="cuda")
    for warps in (1, 2, 1, 4, 2):
        out = torch.zeros_like(x)
        launch[(5,)](x, out, 300, 300, 2.0, BLOCK=64, ADD_ONE=False, num_warps=warps)
        torch.testing.assert_close(out, x * 2.0)
    assert launch.entries == 3
    assert {c.metadata.num_warps for c in launch._cache.values()} == {1, 2, 4}


def _scale(launch, x, out, n, n_loose, scale, add_one):  # type: ignore[no-untyped-def]
    grid = (triton.cdiv(x.numel(), 64),)
    launch[grid](x, out, n, n_loose, scale, BLOCK=64, ADD_ONE=add_one)
    return out


def _expected(x: torch.Tensor, n: int, scale: float, add_one: bool) -> torch.Tensor:
    out = torch.zeros_like(x)
    out[:n] = x[:n] * scale + (1.0 if add_one else 0.0)
    return out


def test_interpreted_kernels_pass_through() -> None:
    launch = FastLaunch(_scale_kernel)
    x = torch.randn(100)
    out = _scale(launch, x, torch.zeros(100), 70, 100, 2.0, True)
    torch.testing.assert_close(out, _expected(x, 70, 2.0, True))
    assert launch.entries == 0


@pytest.mark.gpu
def test_remembered_launches_compute_what_triton_computes() -> None:
    launch = FastLaunch(_scale_kernel)
    base = torch.randn(1000, device="cuda")
    calls = {"triton": 0}
    original = _scale_kernel.run

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["triton"] += 1
        return original(*args, **kwargs)

    _scale_kernel.run = counted
    try:
        cases = [
            (base, 1000, 2.0, False),
            (base, 1000, 3.0, False),  # floats are keyed by value too (finer than Triton)
            (base[1:], 999, 2.0, False),  # misaligned view: its own key
            (base[1:], 999, -1.5, True),  # constexpr changed
            (base, 17, 2.0, True),  # n not a multiple of 16
            (base.half(), 1000, 2.0, True),
        ]
        for x, n, scale, add_one in cases:
            for n_loose in (n, n + 5, n + 16):  # loose: same key for each
                out = _scale(launch, x, torch.full_like(x, 7.0), n, n_loose, scale, add_one)
                torch.testing.assert_close(out[:n], _expected(x, n, scale, add_one)[:n])
                torch.testing.assert_close(out[n:], torch.full_like(out[n:], 7.0))
    finally:
        del _scale_kernel.run
    assert launch.entries == 6
    assert calls["triton"] == 6  # the other 12 launches skipped Triton's binding


@pytest.mark.gpu
def test_launch_hooks_still_see_remembered_launches() -> None:
    from triton import knobs

    launch = FastLaunch(_scale_kernel)
    x = torch.randn(256, device="cuda")
    seen: list[str] = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(3):
            _scale(launch, x, torch.zeros_like(x), 256, 256, 2.0, False)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_scale_kernel"] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_chained_launches_read_their_predecessors_writes(graph: bool) -> None:
    """200 launches, each reading what the one before wrote (x ← 1.01·x + 1 in place, one
    big grid so launches overlap if they may): with PDL the chain must still be serial."""
    launch = FastLaunch(_scale_kernel)
    n = 1 << 20
    x = torch.ones(n, device="cuda")
    grid = (n // 1024,)

    def chain() -> None:
        for _ in range(200):
            launch[grid](x, x, n, n, 1.01, BLOCK=1024, ADD_ONE=True)

    chain()  # compiles and remembers outside any capture
    x.fill_(1.0)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain()
        x.fill_(1.0)
        g.replay()
    else:
        chain()
    expected = torch.ones(1, dtype=torch.float64, device="cuda")
    for _ in range(200):
        expected = expected * torch.tensor(1.01, dtype=torch.float32).double() + 1.0
    torch.testing.assert_close(x, expected.float().expand(n), rtol=1e-5, atol=0)
