"""Launch a compiled Triton kernel again without Triton's per-call argument binding.

An eager prefill step with adapters makes ~1000 Triton launches, and on an H100 host a
`kernel[grid](...)` call costs ~20 µs of which ~10 µs is Triton binding and specialising
every argument to find the compiled kernel (`bench/triton_launch.py`); the step's host time
then exceeds its GPU time (docs/benchmarks.md). `FastLaunch` remembers, per exact argument
key, the compiled kernel Triton chose, and later calls with an equal key go straight to its
driver launch.

The key is finer than Triton's specialisation, so it never picks a kernel Triton would not:
tensors by (dtype, 16-byte alignment of the data pointer), integers by value (by width
class only for `do_not_specialize` parameters, whose value Triton does not specialise on),
everything else (floats, strings, bools, None, triton dtypes) by type and value, plus the
launch options. A key seen for the first time goes through Triton's own launch, which
compiles if needed.

Compiled kernels are launched with programmatic dependent launch where `kernels.pdl` says
so. Under TRITON_INTERPRET=1 (CPU tests) kernels are interpreted functions: every call goes
through Triton.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.nn import Parameter
from triton import knobs
from triton.knobs import HookChain
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from kernels import pdl

# Compiled-kernel entries a kernel keeps; past it the cache starts again. Integers are keyed
# by value, so an argument that takes a new value every step (a token count not marked
# do_not_specialize) would otherwise grow the cache for as long as the server runs.
MAX_ENTRIES = 1024
# Width classes Triton gives an unspecialised integer argument (i32 / i64 / u64).
_I32_MAX, _I64_MAX = 2**31 - 1, 2**63 - 1


def _int_width(value: int) -> int:
    if -_I32_MAX - 1 <= value <= _I32_MAX:
        return 32
    return 64 if value <= _I64_MAX else 65


def launch_key(values: tuple[Any, ...], loose: frozenset[int]) -> tuple[Any, ...]:
    """One entry per argument: what decides which compiled kernel Triton launches, or more.

    Args:
        values: the kernel's arguments in signature order (constexprs included).
        loose: positions of `do_not_specialize` parameters (keyed by integer width only).
    """
    # One list comprehension: this runs for every launch (~2 µs for 22 arguments on the
    # CPU machine; a loop with isinstance took 5.8). Non-int values carry their type
    # because True == 1 == 1.0 as keys.
    key = [
        (v.dtype, v.data_ptr() & 15 == 0)
        if (kind := type(v)) is Tensor or kind is Parameter
        else (v if kind is int else (kind, v))
        for v in values
    ]
    for i in loose:
        key[i] = (int, _int_width(key[i])) if type(key[i]) is int else key[i]
    return tuple(key)


class FastLaunch:
    """`FastLaunch(kernel)[grid](*args, **kwargs)` launches like `kernel[grid](...)`.

    Every parameter must be passed (positionally, then by name); defaults are not applied.
    Launch options (num_warps, num_stages, ...) may follow by name.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        # Interpreted kernels (TRITON_INTERPRET=1) are not JITFunctions: passed through.
        self._jit = isinstance(kernel, JITFunction)
        if self._jit:
            self._names = tuple(kernel.arg_names)
            self._params = frozenset(self._names)
            self._loose = frozenset(p.num for p in kernel.params if p.do_not_specialize)
        # (device, key) -> Triton's CompiledKernel
        self._cache: dict[tuple[Any, ...], Any] = {}

    @property
    def entries(self) -> int:
        """Argument keys remembered now (benchmarks report it: a kernel whose count grows
        with the steps has an argument that changes every step)."""
        return len(self._cache)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._jit:
            self.kernel[grid](*args, **kwargs)
            return
        names = self._names
        try:
            values = args + tuple(kwargs[name] for name in names[len(args) :])
        except KeyError:
            raise TypeError(
                f"{names} must all be passed (positionally, then by name), got "
                f"{len(args)} positional and {sorted(kwargs)}"
            ) from None
        # Names past the parameters are launch options (num_warps, num_stages, ...), which
        # Triton compiles into the kernel: part of the key.
        options = ()
        if len(args) + len(kwargs) > len(names):
            options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self._params))
        device = driver.active.get_current_device()
        key = (device, options, launch_key(values, self._loose))
        compiled = self._cache.get(key)
        if compiled is None:
            # Every kernel of kernels/ waits for its predecessor's writes first (kernels.pdl),
            # so it may be launched before that predecessor has finished.
            compiled = self.kernel[grid](*args, **kwargs, launch_pdl=pdl.enabled())
            if hasattr(compiled, "result"):  # Triton's asynchronous compile mode
                compiled = compiled.result()
            if len(self._cache) >= MAX_ENTRIES:
                self._cache.clear()
            self._cache[key] = compiled
            return
        stream = driver.active.get_current_stream(device)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _hooked(enter) or _hooked(leave):
            metadata = compiled.launch_metadata(grid, stream, *values)
        else:
            # Triton 3.6 passes empty hook chains by default, which the driver launch then
            # calls twice with a metadata dict built for them: skipped when nothing listens.
            metadata = enter = leave = None
        grid_3 = (*grid, 1, 1)
        compiled.run(
            grid_3[0], grid_3[1], grid_3[2], stream, compiled.function, compiled.packed_metadata,
            metadata, enter, leave, *values,
        )  # fmt: skip


def _hooked(hook: Any) -> bool:
    """Whether a launch hook knob holds something to call (an empty chain holds nothing)."""
    if hook is None:
        return False
    return not isinstance(hook, HookChain) or bool(hook.calls)


# By id(kernel): hashing a JITFunction computes its cache key (0.38 µs against 0.10 for an
# id on the CPU machine, once per launch); the FastLaunch holds the kernel, so its id is not reused.
_LAUNCHERS: dict[int, FastLaunch] = {}


def fast(kernel: Any) -> FastLaunch:
    """The process's one `FastLaunch` of `kernel`: `fast(kernel)[grid](...)` at call sites."""
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is None:
        launcher = _LAUNCHERS[id(kernel)] = FastLaunch(kernel)
    return launcher


def remembered_keys() -> dict[str, int]:
    """Argument keys each launched kernel remembers now, by kernel name (benchmarks write it
    down: a count near MAX_ENTRIES means an argument changes every step)."""
    return {str(getattr(f.kernel, "__name__", f.kernel)): f.entries for f in _LAUNCHERS.values()}
