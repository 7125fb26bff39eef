"""bench.provenance: the revision a result file records (clean, dirty, no repository), the
command that reproduces the run and its UTC date."""

from __future__ import annotations

import re
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bench import provenance as prov

HASH = re.compile(r"[0-9a-f]{40}")


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A one-commit repository the bench code appears to live in."""
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    (root / "a.txt").write_text("one\n")
    git(root, "add", "a.txt")
    git(root, "commit", "-q", "-m", "first")
    monkeypatch.setattr(prov, "REPO_ROOT", root)
    return root


def test_a_clean_checkout_records_its_commit(repo: Path) -> None:
    (repo / "untracked.json").write_text("{}")  # result files written beside: still clean
    revision = prov.source_revision()
    assert revision == git(repo, "rev-parse", "HEAD")
    assert HASH.fullmatch(revision)


def test_a_modified_tracked_file_marks_the_commit_dirty(repo: Path) -> None:
    (repo / "a.txt").write_text("two\n")
    assert prov.source_revision() == git(repo, "rev-parse", "HEAD") + "+dirty"


def test_a_tree_without_git_is_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prov, "REPO_ROOT", tmp_path)
    assert prov.source_revision() == "unknown"


def test_a_copy_inside_another_repository_does_not_take_its_commit(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = repo / "copied_tree"
    copy.mkdir()
    monkeypatch.setattr(prov, "REPO_ROOT", copy)
    assert prov.source_revision() == "unknown"


def test_no_git_program_is_unknown(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(repo / "no-such-bin"))
    assert prov.source_revision() == "unknown"


def test_this_checkout_records_its_own_head() -> None:
    root = Path(prov.__file__).resolve().parents[1]
    head = git(root, "rev-parse", "HEAD")
    dirty = git(root, "status", "--porcelain", "--untracked-files=no")
    assert prov.source_revision() == (f"{head}+dirty" if dirty else head)


def test_command_date_and_revision(repo: Path) -> None:
    meta = prov.provenance("serve_offline", ["--out", "x.json", "--smoke"], "python")
    assert meta["command"] == "python -m bench.serve_offline --out x.json --smoke"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["date"])
    recorded = datetime.strptime(meta["date"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert abs(datetime.now(UTC) - recorded) < timedelta(minutes=1)  # UTC, not local time
    assert meta["revision"] == git(repo, "rev-parse", "HEAD")
    assert prov.provenance("ceilings", [])["command"] == "python3 -m bench.ceilings"


def test_argv_defaults_to_this_process_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["ignored.py", "--out", "y.json"])
    assert prov.provenance("moe_routing")["command"] == "python3 -m bench.moe_routing --out y.json"
