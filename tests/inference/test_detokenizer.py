"""Incremental detokenization: whole characters only, left-context spaces, stop strings."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from inference_svc.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXT = "Grüße aus Köln! 世界 is 'world' 🎉🎉 — naïve café, ok."
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "Grüße aus Köln, café naïve, 世界 and more words here",
] * 20


class ByteDecoder:
    """The byte-level fallback tokenizer: token id = UTF-8 byte."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def _byte_level_bpe() -> Tokenizer:
    """GPT-2 style: tokens are byte sequences, so one token may end inside a character."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def _sentencepiece_like() -> Tokenizer:
    """Llama style: "▁" marks spaces, the decoder strips the first one, bytes fall back to
    <0xNN> tokens."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=byte_tokens, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> list[str]:
    pieces = [detok.add(ids[i : i + chunk]).text for i in range(0, len(ids), chunk)]
    return [*pieces, detok.finish()]


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_byte_tokenizer_never_splits_a_character(chunk: int) -> None:
    decoder = ByteDecoder()
    pieces = _stream(IncrementalDetokenizer(decoder), decoder.encode(TEXT), chunk)
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces[-1] == ""  # nothing was left over


@pytest.mark.parametrize("build", [_byte_level_bpe, _sentencepiece_like])
@pytest.mark.parametrize("chunk", [1, 3])
def test_tokenizers_stream_equals_full_decode(build, chunk: int) -> None:
    tokenizer = build()
    ids = tokenizer.encode(TEXT).ids
    full = tokenizer.decode(ids)
    assert "\ufffd" not in full and "世界" in full
    pieces = _stream(IncrementalDetokenizer(tokenizer), ids, chunk)
    assert "".join(pieces) == full
    assert all("\ufffd" not in piece for piece in pieces)
    if chunk == 1:
        # The byte-level tokenizer splits multi-byte characters over tokens: some steps
        # must have held text back.
        assert "" in pieces[:-1]


def test_prompt_context_keeps_the_leading_space() -> None:
    tokenizer = _sentencepiece_like()
    prompt, answer = tokenizer.encode("hello").ids, tokenizer.encode("hello world").ids
    generated = answer[len(prompt) :]
    detok = IncrementalDetokenizer(tokenizer, context_ids=prompt)
    assert detok.add(generated).text + detok.finish() == " world"


def test_truncated_character_at_the_end_is_flushed_as_replacement() -> None:
    decoder = ByteDecoder()
    detok = IncrementalDetokenizer(decoder)
    assert detok.add(decoder.encode("ok ")).text == "ok "
    assert detok.add(list("世".encode())[:2]).text == ""
    assert detok.finish() == "\ufffd"


def test_stop_string_across_tokens_is_cut_off() -> None:
    decoder = ByteDecoder()
    detok = IncrementalDetokenizer(decoder, stop=["STOP"])
    pieces = [detok.add([token]) for token in decoder.encode("abc STOP def")]
    assert "".join(piece.text for piece in pieces) == "abc "
    stopped_at = next(i for i, piece in enumerate(pieces) if piece.stopped)
    assert stopped_at == len("abc STOP") - 1
    assert detok.stopped and detok.finish() == ""


def test_stop_string_with_multibyte_characters() -> None:
    decoder = ByteDecoder()
    detok = IncrementalDetokenizer(decoder, stop=["界 is"])
    pieces = _stream(detok, decoder.encode(TEXT), 1)
    assert "".join(pieces) == TEXT[: TEXT.index("界 is")]


def test_false_start_of_a_stop_string_is_emitted() -> None:
    matcher = StopStringMatcher(["STOP", "xyz"])
    assert matcher.feed("aS").text == "a"
    assert matcher.feed("T").text == ""
    assert matcher.feed("X").text == "STX"
    assert matcher.feed("S").text == ""
    assert matcher.flush() == "S"


def test_earliest_stop_string_wins() -> None:
    matcher = StopStringMatcher(["cd", "b"])
    step = matcher.feed("abcd")
    assert step.text == "a" and step.stopped
    assert matcher.feed("more").text == "" and matcher.flush() == ""


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher([""])
