"""What a benchmark's result file records about its own run: the command that reproduces
it, when it ran (UTC) and which source revision produced the figures."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
GIT_TIMEOUT_S = 5.0


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=GIT_TIMEOUT_S,
    ).stdout.strip()


def source_revision() -> str:
    """The commit the bench code's checkout is at, `+dirty` when tracked files differ from
    it, "unknown" where there is no git or no repository (a copied tree on a GPU host)."""
    try:
        toplevel, commit = _git("rev-parse", "--show-toplevel", "HEAD").splitlines()
        # A copy without .git inside some other repository must not report that one's commit.
        if Path(toplevel).resolve() != REPO_ROOT.resolve():
            return "unknown"
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError, ValueError):
        return "unknown"
    return f"{commit}+dirty" if dirty else commit


def provenance(
    benchmark: str, argv: Sequence[str] | None = None, interpreter: str = "python3"
) -> dict[str, str]:
    """The "command", "date" (ISO-8601 UTC) and "revision" entries of a result file;
    `argv` defaults to this process's arguments."""
    args = sys.argv[1:] if argv is None else argv
    return {
        "command": " ".join([f"{interpreter} -m bench.{benchmark}", *args]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "revision": source_revision(),
    }
