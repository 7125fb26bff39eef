"""One generation request as the engine sees it: its tokens, its place in the KV cache, its
adapter reference, and what it still owes the client.

A sequence's tokens are `prompt + output`, plus at most one token drawn on the device whose
id the host does not know yet (`pending_token`: the engine launches the next step before it
reads the last step's tokens back); `num_computed` of them are in the KV cache. A step runs
tokens `[num_computed, num_computed + query_len)`; when a step reaches the last token, its
logits sample the next one. Preemption (recompute) sets `num_computed` back to 0 and keeps
the output, so the re-run prefill covers prompt and output and sampling goes on where it
stopped, with the same random generator.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from adapter_store.errors import InvalidArgument, LoraserveError
from inference_svc.engine.detokenizer import Decoder, IncrementalDetokenizer
from inference_svc.engine.lora_slots import SlotHandle
from inference_svc.engine.sampling import SamplingParams

AdapterKey = Hashable  # (tenant, name, version); None is the base model

# Prompt tokens given to the detokenizer as left context for the first generated token.
_DETOKENIZER_CONTEXT = 4


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again
    RUNNING = "running"  # holds KV pages and is scheduled every step
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class GenerationParams:
    """Everything about a request except its prompt and adapter."""

    max_new_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop strings must not be empty")


@dataclass(frozen=True)
class AdapterBinding:
    """The adapter version a request runs with, fixed when the request is accepted (the
    store's record of it: enough to fetch and verify the weights)."""

    tenant: str
    name: str
    version: int
    rank: int
    sha256: str
    size_bytes: int
    base_model: str
    parts_sha256: str = ""  # the record's binding of its per-part digests ("" if none)
    # The API key of the caller who resolved it, forwarded when the weights are fetched
    # through the store (not part of the adapter's identity).
    caller_key: str = field(default="", compare=False, repr=False)

    @property
    def key(self) -> AdapterKey:
        return (self.tenant, self.name, self.version)

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class SequenceOutput:
    """What one step produced for one request (streamed as one GenerateResponse)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float]
    prompt_logprobs: list[float] | None = None  # first output only, when requested
    finish_reason: FinishReason | None = None
    error: LoraserveError | None = None  # with finish_reason ERROR


OutputSink = Callable[[SequenceOutput], None]


class Sequence:
    """Mutable request state; touched only by the engine thread once submitted."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: GenerationParams,
        tokenizer: Decoder,
        eos_token_ids: tuple[int, ...],
        adapter: AdapterBinding | None = None,
        sink: OutputSink | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise InvalidArgument("the prompt is empty (give prompt text or prompt_token_ids)")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.adapter = adapter
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        self.sink = sink
        self.status = SequenceStatus.WAITING
        self.num_computed = 0
        # The last token while it exists only on the device: (sampled ids [B], row).
        self.pending_token: tuple[Tensor, int] | None = None
        self.pages: list[int] = []
        self.slot_handle: SlotHandle | None = None
        # Made on the logits' device when the engine accepts the request.
        self.generator: torch.Generator | None = None
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, params.stop, self.prompt_token_ids[-_DETOKENIZER_CONTEXT:]
        )
        # Logprob of prompt token i (i ≥ 1) once scored; filled during the first prefill.
        self.prompt_logprobs: list[float] = []
        self.prompt_logprobs_sent = False
        self.finish_reason: FinishReason | None = None
        self.arrival_s = time.monotonic()
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.preemptions = 0

    @property
    def adapter_key(self) -> AdapterKey:
        return None if self.adapter is None else self.adapter.key

    @property
    def lora_slot(self) -> int:
        """The pool slot of this request's adapter, -1 for the base model."""
        return -1 if self.slot_handle is None else self.slot_handle.slot

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, the pending one included."""
        return self.num_host_tokens + (self.pending_token is not None)

    @property
    def num_host_tokens(self) -> int:
        """Tokens whose ids the host knows: prompt and accepted output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def pending_ends_by_length(self, max_model_len: int) -> bool:
        """The pending token will end the sequence by length (max_new_tokens or the model
        length), whatever its id: the sequence needs no further step."""
        if self.pending_token is None:
            return False
        return (
            len(self.output_token_ids) + 1 >= self.params.max_new_tokens
            or self.num_tokens >= max_model_len
        )

    @property
    def num_remaining(self) -> int:
        """Tokens not yet in the KV cache (1 for a sequence in decode)."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs and len(self.prompt_logprobs) < (
            len(self.prompt_token_ids) - 1
        )

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output (0 <= start, end <= num_host_tokens).

        Slices the two lists rather than joining them: a decode asks for one token every
        step, and a copy of its whole history would grow with the sequence.
        """
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        output = self.output_token_ids[max(start - len(prompt), 0) : end - len(prompt)]
        return prompt[start:] + output if start < len(prompt) else output
