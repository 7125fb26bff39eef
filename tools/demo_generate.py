"""The demo's generations: each prompt sent with the base model and every adapter at once
(one batch mixing them), greedy, timed from the client's side."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from protos import inference_pb2 as pb
from protos import inference_pb2_grpc


@dataclass(frozen=True)
class Completion:
    adapter: str  # "" is the base model
    text: str
    tokens: int
    ttft_s: float  # request sent → first token received
    total_s: float  # request sent → last message received

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first ÷ the time they took (0 when there is nothing to time)."""
        decode_s = self.total_s - self.ttft_s
        return (self.tokens - 1) / decode_s if self.tokens > 1 and decode_s > 0 else 0.0


async def _generate(
    stub: inference_pb2_grpc.InferenceStub, adapter: str, prompt: str, max_new_tokens: int
) -> Completion:
    request = pb.GenerateRequest(
        adapter=adapter,
        prompt=prompt,
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
    )
    sent = time.perf_counter()
    first: float | None = None
    text, tokens = [], 0
    async for message in stub.Generate(request, timeout=300):
        if first is None and message.token_ids:
            first = time.perf_counter()
        tokens += len(message.token_ids)
        text.append(message.text)
    done = time.perf_counter()
    return Completion(adapter, "".join(text), tokens, (first or done) - sent, done - sent)


async def generate_side_by_side(
    address: str, prompts: Sequence[str], adapters: Sequence[str], max_new_tokens: int
) -> list[list[Completion]]:
    """For each prompt, one completion per entry of `adapters` ("" = base), in order."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return [
            list(
                await asyncio.gather(
                    *(_generate(stub, adapter, prompt, max_new_tokens) for adapter in adapters)
                )
            )
            for prompt in prompts
        ]
