"""`--model tiny`: the small trained DeepSeek-V3 shipped in `inference_svc/embedded/base`
(see docs/demo_model.md)."""

from __future__ import annotations

from pathlib import Path

# What `--model tiny` serves: an HF folder with config.json, safetensors and tokenizer.json.
EMBEDDED_BASE_DIR = Path(__file__).resolve().parents[1] / "embedded" / "base"
EMBEDDED_ADAPTERS_DIR = EMBEDDED_BASE_DIR.parent / "adapters"
TINY_MODEL_NAME = "tiny"


def model_folder(model: str) -> Path:
    """The HF folder `--model` names: the embedded demo model for "tiny", else the path."""
    return EMBEDDED_BASE_DIR if model == TINY_MODEL_NAME else Path(model)
