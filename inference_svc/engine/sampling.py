"""Batched token sampling with per-request parameters and per-request random streams.

Each row of the logits batch has its own temperature, top-k, top-p and torch.Generator.
A seeded request's tokens depend only on its own logits and its own generator, never on
which other requests share the batch: the filtering is row-wise and every random draw for
a row comes from that row's generator (B small draws instead of one batched draw; vLLM
does the same for seeded requests).

The returned logprob of a token is `log_softmax(logits)` of the model's *unmodified*
logits, whatever the temperature, top-k or top-p: it is the model's probability of the
token, the same quantity as `prompt_logprobs` and as the transformers oracle reports, and
it does not change when a client changes its sampling knobs (vLLM's default, "raw
logprobs").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from inference_svc.engine.uploads import to_device


@dataclass(frozen=True)
class SamplingParams:
    """How one request draws its tokens. temperature 0 is greedy; top_k 0 and top_p 1 are
    off. The service edge maps the proto's "0 means off" top_p to 1."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SampleOutput:
    token_ids: Tensor  # int64 [B]
    logprobs: Tensor  # float32 [B], log_softmax of the unmodified logits at token_ids

    def start_host_copy(self) -> SampledOnHost:
        """Queue the copy of token ids and logprobs to the host behind the sampling, in one
        device→host copy (logprobs bit for bit as float64 inside an int64 row), without
        waiting: on CUDA into pinned memory, with an event to wait for it alone. Work
        queued after it (the next step) does not delay it, as a `.cpu()` issued later
        would be delayed."""
        logprob_bits = self.logprobs.double().view(torch.int64)
        packed = torch.stack((self.token_ids, logprob_bits))  # [2, B]
        if not packed.is_cuda:
            return SampledOnHost(packed, None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return SampledOnHost(host, copied)


@dataclass(frozen=True)
class SampledOnHost:
    """Sampled ids and logprobs on their way to the host (`SampleOutput.start_host_copy`)."""

    packed: Tensor  # int64 [2, B] on the host: ids, float64 bits of the logprobs
    copied: torch.cuda.Event | None  # recorded after the copy; None: already there

    def to_lists(self) -> tuple[list[int], list[float]]:
        """Wait for the copy (only it) and return ids and logprobs as Python lists, as
        `.tolist()` of each gives them."""
        if self.copied is not None:
            self.copied.synchronize()
        host = self.packed.numpy()
        return host[0].tolist(), host[1].view(np.float64).tolist()


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's random stream: seeded when the client gave a seed, else from entropy.

    Create it once per request and pass it to every `sample` call of that request.
    """
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        # manual_seed takes a signed 64-bit value; the proto's seed is uint64.
        generator.manual_seed(seed - 2**64 if seed >= 2**63 else seed)
    return generator


def sample(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> SampleOutput:
    """Draw one token per row.

    Semantics: for row b, greedy: argmax(logits[b]); else p = softmax(logits[b] / T_b)
    restricted to its top_k_b tokens, then to the smallest prefix (by probability) whose
    mass reaches top_p_b, renormalised; token ~ p using generators[b].
    Args:
        logits: [B, V] model logits (any float dtype; computed in float32).
        params: B sampling parameters.
        generators: B generators, on the logits' device (ignored for greedy rows).
    Returns token ids int64 [B] and their logprobs float32 [B] (unmodified logits).
    """
    if logits.dim() != 2 or not len(params) == len(generators) == logits.shape[0]:
        raise ValueError(
            f"logits must be [B, V] with B params and generators, got {list(logits.shape)}, "
            f"{len(params)} params, {len(generators)} generators"
        )
    logits = logits.float()
    token_ids = logits.argmax(dim=-1)  # [B]; rows that sample overwrite theirs
    sampled_rows = [row for row, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = to_device(torch.tensor(sampled_rows), logits.device)
        probs = filtered_probs(logits[rows], [params[row] for row in sampled_rows])  # [b, V]
        for index, row in enumerate(sampled_rows):
            token_ids[row] = _draw(probs[index], generators[row])
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, token_ids[:, None]).squeeze(1)
    return SampleOutput(token_ids, logprobs)


def filtered_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Row-wise probabilities after temperature, top-k and top-p (rows: non-greedy params).

    Args: logits [b, V] float32. Returns [b, V] float32, each row summing to 1, zero outside
    the kept tokens. Ties at the top-k threshold are all kept.
    """
    vocab = logits.shape[-1]
    knobs = to_device(
        torch.tensor(
            [[p.temperature, p.top_k if 0 < p.top_k < vocab else vocab, p.top_p] for p in params],
            dtype=torch.float64,
        ),
        logits.device,
    )  # [b, 3]; top-k counts are exact in float64
    temperature = knobs[:, 0].float()  # [b]
    top_k = knobs[:, 1].long()  # [b]
    top_p = knobs[:, 2].float()  # [b]

    scaled = logits / temperature[:, None]  # [b, V]
    ordered, order = scaled.sort(dim=-1, descending=True)  # [b, V]
    kth = ordered.gather(1, (top_k - 1)[:, None])  # [b, 1]
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    sorted_probs = ordered.softmax(dim=-1)  # [b, V], top-k renormalised
    # Keep a token when the mass strictly before it is below top_p: the smallest prefix
    # reaching top_p, and always the most likely token.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)


def _draw(probs: Tensor, generator: torch.Generator) -> Tensor:
    """One token ~ probs [V] from `generator`: argmax(p / Exp(1) noise) is a draw from p
    (the exponential race), without multinomial's host sync on CUDA."""
    noise = torch.empty_like(probs).exponential_(generator=generator)  # [V]
    return (probs / noise).argmax()
