"""Incremental detokenization for streaming: whole characters only, stop strings cut off.

Decoding one token at a time is wrong in two ways: a token may hold part of a multi-byte
UTF-8 character (byte-level BPE, the byte fallback tokenizer), and some decoders drop or
add spaces depending on the tokens around (sentencepiece's leading "▁"). So, like TGI and
vLLM, each step decodes a short window that starts one emitted chunk back and emits only
what the new tokens added; while the window's text ends in U+FFFD (an incomplete
character) nothing is emitted and the window grows.

Stop strings: text that might be the start of a stop string is held back until it either
completes one (then the text before it is emitted, the stop string and anything after it
are not) or turns out not to be one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer (both tokenizers of `inference_svc.model`
    and a `tokenizers.Tokenizer` fit): undecodable bytes come back as U+FFFD."""

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class DetokenizedText:
    text: str  # new complete text to stream (may be empty)
    stopped: bool  # a stop string was completed; generation should finish with "stop"


class StopStringMatcher:
    """Cuts a text stream at the first stop string, across chunk boundaries."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> DetokenizedText:
        """Add text; returns what can be emitted now."""
        if self.stopped:
            return DetokenizedText("", True)
        if not self.stops:  # most requests: nothing to hold back, no search per token
            return DetokenizedText(text, False)
        buffer = self._held + text
        found = [index for index in (buffer.find(stop) for stop in self.stops) if index >= 0]
        if found:
            self._held, self.stopped = "", True
            return DetokenizedText(buffer[: min(found)], True)
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return DetokenizedText(buffer[: len(buffer) - keep], False)

    def flush(self) -> str:
        """End of generation: held text did not become a stop string, emit it."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop."""
        for length in range(min(len(buffer), max(map(len, self.stops), default=1) - 1), 0, -1):
            tail = buffer[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0


class IncrementalDetokenizer:
    """Turns one request's generated token ids into streamable text."""

    def __init__(
        self, tokenizer: Decoder, stop: Sequence[str] = (), context_ids: Sequence[int] = ()
    ) -> None:
        """`context_ids`: tokens before the generated ones (e.g. the prompt's last few), so
        the first generated token decodes with its left context; they are never emitted."""
        self._tokenizer = tokenizer
        self._ids = list(context_ids)
        # ids[prefix:read] were emitted last time (the window's left context);
        # ids[read:] are not emitted yet.
        self._prefix = 0
        self._read = len(self._ids)
        self._stops = StopStringMatcher(stop)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def add(self, token_ids: Iterable[int]) -> DetokenizedText:
        """Add newly generated tokens; returns the text they complete."""
        pieces: list[str] = []
        for token_id in token_ids:
            self._ids.append(token_id)
            step = self._stops.feed(self._window_text(final=False))
            pieces.append(step.text)
            if step.stopped:
                break
        return DetokenizedText("".join(pieces), self._stops.stopped)

    def finish(self) -> str:
        """End of generation: everything still held (an incomplete character becomes
        U+FFFD; text that was a possible stop-string start is emitted)."""
        if self._stops.stopped:
            return ""
        rest = self._window_text(final=True)
        return self._stops.feed(rest).text + self._stops.flush()

    def _window_text(self, final: bool) -> str:
        """Text the not-yet-emitted tokens add to the last emitted chunk; "" while it ends
        in an incomplete character (unless `final`)."""
        emitted = self._tokenizer.decode(self._ids[self._prefix : self._read])
        window = self._tokenizer.decode(self._ids[self._prefix :])
        if len(window) <= len(emitted) or (window.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return window[len(emitted) :]
