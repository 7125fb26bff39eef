"""Text layout of the demo's results: one column per adapter, side by side when the
terminal is wide enough, one block after another when not."""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

from tools.demo_generate import Completion

GAP = " │ "
MIN_COLUMN = 26  # below this a column of code is unreadable: stack the blocks instead


def _printable(line: str) -> str:
    line = line.replace("\t", "    ")
    return "".join(c if unicodedata.category(c)[0] != "C" else "?" for c in line)


def text_lines(text: str, width: int) -> list[str]:
    """`text` as lines of at most `width` characters; long lines are cut, not re-flowed,
    so code keeps its indentation."""
    lines = []
    for line in map(_printable, text.split("\n")):
        lines += [line[i : i + width] for i in range(0, len(line), width)] or [""]
    return lines


def label(adapter: str) -> str:
    return adapter or "base model"


def timing(completion: Completion) -> str:
    return f"TTFT {completion.ttft_s * 1e3:.0f} ms · {completion.decode_tokens_per_s:.0f} tok/s"


def _columns(completions: Sequence[Completion], width: int) -> list[str]:
    bodies = [text_lines(c.text, width) for c in completions]
    height = max(len(body) for body in bodies)
    rule = "─" * width
    cells = [
        [label(c.adapter), rule, *body, *[""] * (height - len(body)), rule, timing(c)]
        for c, body in zip(completions, bodies, strict=True)
    ]
    return [
        GAP.join(cell[row][:width].ljust(width) for cell in cells).rstrip()
        for row in range(height + 4)
    ]


def _blocks(completions: Sequence[Completion], width: int) -> list[str]:
    lines = []
    for c in completions:
        lines += [f"── {label(c.adapter)} ({timing(c)})", *text_lines(c.text, width), ""]
    return lines


def render_prompt(prompt: str, completions: Sequence[Completion], terminal_width: int) -> str:
    """The prompt, then its completions side by side (or stacked on a narrow terminal)."""
    n = len(completions)
    column = (terminal_width - len(GAP) * (n - 1)) // n
    body = (
        _columns(completions, column)
        if column >= MIN_COLUMN
        else _blocks(completions, terminal_width)
    )
    return "\n".join([f"prompt {prompt!r}", *body])
