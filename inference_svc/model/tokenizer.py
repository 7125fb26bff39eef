"""Tokenizers: the checkpoint's `tokenizer.json` (via `tokenizers`) or a byte-level fallback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from inference_svc.model.config import ModelConfig


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Token id = UTF-8 byte value; ids ≥ 256 decode to nothing."""

    chat_template = None

    def __init__(self, bos_token_id: int | None = None, eos_token_ids: tuple[int, ...] = ()):
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` tokenizer plus the chat template from `tokenizer_config.json`."""

    def __init__(self, folder: Path, config: ModelConfig):
        from tokenizers import Tokenizer as RustTokenizer

        self._tok = RustTokenizer.from_file(str(folder / "tokenizer.json"))
        meta_path = folder / "tokenizer_config.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        template_file = folder / "chat_template.jinja"
        self.chat_template = meta.get("chat_template") or (
            template_file.read_text() if template_file.is_file() else None
        )
        self.bos_token = _token_text(meta.get("bos_token"))
        self.eos_token = _token_text(meta.get("eos_token"))
        self.bos_token_id = config.bos_token_id
        self.eos_token_ids = config.eos_token_ids
        if self.eos_token and not self.eos_token_ids:
            eos = self._tok.token_to_id(self.eos_token)
            self.eos_token_ids = () if eos is None else (eos,)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` with the model's chat template (jinja2, sandboxed)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _token_text(token: str | dict | None) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def load_tokenizer(folder: Path, config: ModelConfig) -> Tokenizer:
    """`tokenizer.json` when the folder has one, else bytes."""
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder, config)
    return ByteTokenizer(config.bos_token_id, config.eos_token_ids)
