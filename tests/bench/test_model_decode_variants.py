"""Every kernel variant of the decode-step A/B bench runs (CPU smoke): a patch whose stand-in
no longer fits the model's call fails here, not in a GPU session."""

from __future__ import annotations

import json
from pathlib import Path

from bench import model_decode
from bench.kernel_variants import VARIANTS


def test_every_variant_runs_a_smoke_step(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    model_decode.main(
        ["--smoke", "--json", str(out), "--plot", str(tmp_path / "decode.png"),
         "--batch-sizes", "2", "--variants", *sorted(VARIANTS)]
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert sorted({r["variant"] for r in rows}) == sorted(VARIANTS)
    assert all(r["step_ms"] > 0 for r in rows)
