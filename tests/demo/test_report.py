"""The demo's side-by-side layout."""

from __future__ import annotations

from tools.demo_generate import Completion
from tools.demo_report import GAP, render_prompt, text_lines

COMPLETIONS = [
    Completion("", "def f():\n    return 1\n", 8, 0.02, 0.30),
    Completion("shouty", "DEF F():\n\tRETURN " + "X" * 70, 8, 0.15, 0.43),
    Completion("docs-prose", "The\x07 value.", 3, 0.10, 0.10),
]


def test_long_lines_are_cut_and_indentation_kept() -> None:
    assert text_lines("    abcdef\nxy", 4) == ["    ", "abcd", "ef", "xy"]
    assert text_lines("\tx\x1b", 10) == ["    x?"]


def test_columns_side_by_side_with_timings_last() -> None:
    lines = render_prompt("def f", COMPLETIONS, 120).splitlines()
    assert lines[0] == "prompt 'def f'"
    header, timings = lines[1], lines[-1]
    assert [cell.strip() for cell in header.split(GAP)] == ["base model", "shouty", "docs-prose"]
    assert [cell.strip() for cell in timings.split(GAP)] == [
        "TTFT 20 ms · 25 tok/s",
        "TTFT 150 ms · 25 tok/s",
        "TTFT 100 ms · 0 tok/s",
    ]
    assert all(len(line) <= 120 for line in lines)
    # Every row has both column borders at the same places (trailing blanks are trimmed).
    borders = [i for i, c in enumerate(header) if c == "│"]
    assert len(borders) == 2
    assert all([i for i, c in enumerate(line) if c == "│"] == borders for line in lines[1:])


def test_narrow_terminal_stacks_the_completions() -> None:
    lines = render_prompt("p", COMPLETIONS, 60).splitlines()
    assert GAP not in "\n".join(lines)
    assert "── shouty (TTFT 150 ms · 25 tok/s)" in lines
    assert all(len(line) <= 60 for line in lines)
