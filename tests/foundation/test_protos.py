"""The committed generated code is exactly what `make protos` produces, and it imports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_FILES = ["protos/adapter_store.proto", "protos/inference.proto"]


def test_regenerating_protos_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "protos").mkdir()
    for proto in PROTO_FILES:
        shutil.copy(REPO_ROOT / proto, tmp_path / proto)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            "--python_out=.",
            "--pyi_out=.",
            "--grpc_python_out=.",
            *PROTO_FILES,
        ],
        cwd=tmp_path,
        check=True,
    )
    generated = sorted(p.name for p in (tmp_path / "protos").glob("*_pb2*.py*"))
    assert generated, "protoc produced nothing"
    for name in generated:
        committed = (REPO_ROOT / "protos" / name).read_bytes()
        assert (tmp_path / "protos" / name).read_bytes() == committed, f"protos/{name} is stale"


def test_generated_modules_import_and_name_the_fixed_services() -> None:
    from protos import adapter_store_pb2, inference_pb2

    assert "AdapterStore" in adapter_store_pb2.DESCRIPTOR.services_by_name
    assert "Inference" in inference_pb2.DESCRIPTOR.services_by_name
    assert adapter_store_pb2.DESCRIPTOR.package == "loraserve.v1"
    assert inference_pb2.DESCRIPTOR.package == "loraserve.v1"
