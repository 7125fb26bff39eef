"""Tokenizers (tokenizer.json and byte fallback) and the `--model tiny` model."""

from __future__ import annotations

import json

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.model_runner import ModelRunner, RunnerConfig
from inference_svc.model.config import parse_config
from inference_svc.model.loader import load_model
from inference_svc.model.tiny import EMBEDDED_BASE_DIR
from inference_svc.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(0, (1,))
    text = "héllo, wörld ✓"
    assert tok.decode(tok.encode(text)) == text
    assert all(0 <= i < 256 for i in tok.encode(text))


def test_tokenizer_json_with_chat_template(tmp_path):
    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    rust = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
        )
    )
    hf_config = json.loads((EMBEDDED_BASE_DIR / "config.json").read_text())
    config = parse_config({**hf_config, "eos_token_id": None})
    tok = load_tokenizer(tmp_path, config)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [2, 3]
    assert tok.eos_token_ids == (1,)
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == "<s>hello "
    assert isinstance(load_tokenizer(tmp_path / "missing", config), ByteTokenizer)


def test_tiny_model_runs_prefill_and_decode_deterministically():
    def greedy(steps: int) -> list[int]:
        loaded = load_model(EMBEDDED_BASE_DIR, device="cpu", dtype=torch.float32)
        runner = ModelRunner(loaded.model, RunnerConfig(num_pages=8, page_size=16))
        ids = loaded.tokenizer.encode("hi there")
        out = []
        batch = build_batch([SequenceStep(0, len(ids), (0,))], 16, "cpu")
        logits = runner.execute(torch.tensor(ids), batch)
        for _ in range(steps):
            token = int(logits[-1].argmax())
            out.append(token)
            ids.append(token)
            batch = build_batch([SequenceStep(len(ids) - 1, 1, (0,))], 16, "cpu")
            logits = runner.execute(torch.tensor([token]), batch)
            assert torch.isfinite(logits).all()
        return out

    assert greedy(5) == greedy(5)
