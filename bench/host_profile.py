"""Where a serving step's host time goes: a cProfile window over some engine steps.

The GPU-side profile (`bench.step_profile`) says what the kernels cost; this one says what
the Python around them costs — the launches themselves (time inside torch and Triton's
launchers) and our own code per step. `summary(steps)` gives per-step milliseconds of the
functions that take the most time themselves (tottime) and of our own functions including
what they call (cumtime), plus the wall time per step under the profiler (cProfile slows
Python-heavy code, so read the split, not the absolute figures).
"""

from __future__ import annotations

import cProfile
import pstats
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
OUR_PACKAGES = ("inference_svc", "kernels", "adapter_store")
TOP = 30
CALLEE_PARENTS = 12  # our functions of largest total time whose callees are listed


def _label(func: tuple[str, int, str]) -> str:
    """'path/relative/to/repo.py:line name', or the builtin's name."""
    file, line, name = func
    if file == "~":
        return name
    path = Path(file)
    try:
        shown = str(path.relative_to(REPO_ROOT))
    except ValueError:
        shown = "/".join(path.parts[-2:])
    return f"{shown}:{line} {name}"


def _is_ours(func: tuple[str, int, str]) -> bool:
    try:
        relative = Path(func[0]).resolve().relative_to(REPO_ROOT)
    except ValueError:
        return False
    return relative.parts[0] in OUR_PACKAGES


class HostProfile:
    """A cProfile window with the interface of `StepProfile` (start / stop / summary)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._profile = cProfile.Profile()
        self._wall_s = 0.0

    def start(self) -> HostProfile:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._began = time.perf_counter()
        self._profile.enable()
        return self

    def stop(self) -> None:
        self._profile.disable()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._wall_s = time.perf_counter() - self._began

    def summary(self, steps: int) -> dict:
        stats = pstats.Stats(self._profile).stats  # func → (cc, ncalls, tottime, cumtime, ..)

        def rows(order: int, keep) -> dict[str, dict[str, float]]:
            picked = sorted(
                (item for item in stats.items() if keep(item[0])),
                key=lambda item: item[1][order],
                reverse=True,
            )[:TOP]
            return {
                _label(func): {
                    "calls_per_step": round(ncalls / steps, 1),
                    "self_ms_per_step": round(tottime * 1e3 / steps, 2),
                    "total_ms_per_step": round(cumtime * 1e3 / steps, 2),
                }
                for func, (_, ncalls, tottime, cumtime, _) in picked
            }

        return {
            "wall_us_per_step": round(self._wall_s * 1e6 / steps, 1),
            "python_calls_per_step": round(sum(s[1] for s in stats.values()) / steps),
            "by_self_time": rows(2, lambda func: True),
            "ours_by_total_time": rows(3, _is_ours),
            "callees": _callees(stats, _largest_ours(stats)[:CALLEE_PARENTS], steps),
        }


def _largest_ours(stats: dict) -> list[tuple[str, int, str]]:
    """Our functions, largest total time first."""
    return sorted((f for f in stats if _is_ours(f)), key=lambda f: stats[f][3], reverse=True)


def _callees(stats: dict, parents: list, steps: int) -> dict[str, dict[str, float]]:
    """For each parent function: ms per step spent in each function it calls directly
    (pstats keeps callers per function; inverted here), largest first."""
    wanted = set(parents)
    found: dict[tuple, dict[str, float]] = {parent: {} for parent in parents}
    for func, (*_, callers) in stats.items():
        for caller, (_, _, _, cumtime) in callers.items():
            if caller in wanted:
                found[caller][_label(func)] = round(cumtime * 1e3 / steps, 2)
    return {
        _label(parent): dict(sorted(calls.items(), key=lambda kv: kv[1], reverse=True)[:TOP])
        for parent, calls in found.items()
    }
