"""The part-digest bench runs end to end on a small buffer (JSON + plot)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.part_digests import main, thread_counts


def test_thread_counts_double_up_to_the_cpus() -> None:
    assert thread_counts(1) == [1]
    assert thread_counts(6) == [1, 2, 4, 6]
    assert thread_counts(16) == [1, 2, 4, 8, 16]


def test_bench_writes_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "digests.json"
    main(["--out", str(out), "--mib", "20", "--repeats", "1"])
    results = json.loads(out.read_text())
    assert results["whole"]["ms_p50"] > 0 and results["parts"][0]["threads"] == 1
    assert out.with_suffix(".png").stat().st_size > 0
