"""Calling Generate in tests, and the transformers(+peft) oracle of a greedy generation."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import grpc
import torch

from inference_svc.model.tiny import EMBEDDED_ADAPTERS_DIR, EMBEDDED_BASE_DIR
from protos import inference_pb2 as pb
from protos import inference_pb2_grpc

LOGPROB_TOL = 1e-4
PROMPTS = (
    "def read_config(path):\n",
    "import os\nimport sys\n\nclass ",
    "The module provides",
    "    for item in items:\n        if ",
)


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    adapter_version: int = 0
    finish_reason: int = 0
    messages: int = 0


def request(
    adapter: str = "",
    prompt: str = PROMPTS[0],
    max_new_tokens: int = 8,
    *,
    logprobs: bool = True,
    prompt_logprobs: bool = True,
    ignore_eos: bool = True,
    **sampling,
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        adapter=adapter,
        prompt=prompt,
        sampling=pb.SamplingParams(
            max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, **sampling
        ),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def collect(stream) -> Generation:
    result = Generation()
    for message in stream:
        result.messages += 1
        if result.messages == 1:
            result.prompt_logprobs = list(message.prompt_logprobs)
            result.prompt_tokens = message.prompt_tokens
            result.adapter_version = message.adapter_version
        result.token_ids += message.token_ids
        result.logprobs += message.logprobs
        result.text += message.text
        result.finish_reason = message.finish_reason
    return result


def generate(stub: inference_pb2_grpc.InferenceStub, req: pb.GenerateRequest) -> Generation:
    return collect(stub.Generate(req, timeout=120))


def status_of(call) -> grpc.StatusCode:
    """The status code a call fails with (it must fail)."""
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    raise AssertionError("the call succeeded")


def load_peft_oracle(adapters: tuple[str, ...]):
    """transformers DeepseekV3ForCausalLM of the embedded model in float32 on CPU, with the
    named embedded adapters loaded by peft (select with `set_adapter`, base:
    `disable_adapter`)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(EMBEDDED_BASE_DIR, dtype=torch.float32)
    first, *rest = adapters
    model = PeftModel.from_pretrained(base.eval(), EMBEDDED_ADAPTERS_DIR / first, first)
    for name in rest:
        model.load_adapter(EMBEDDED_ADAPTERS_DIR / name, adapter_name=name)
    return model.eval()


@torch.no_grad()
def oracle_generation(model, adapter: str, prompt_ids: list[int], n: int) -> Generation:
    """Greedy generation of the peft model with `adapter` ("" = base), full forwards."""
    if adapter:
        model.set_adapter(adapter)
    ids = list(prompt_ids)
    with model.disable_adapter() if not adapter else nullcontext():
        lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [n, V]
        result = Generation(prompt_logprobs=[lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)])
        for _ in range(n):
            token = int(lp[-1].argmax())
            result.token_ids.append(token)
            result.logprobs.append(lp[-1, token].item())
            ids.append(token)
            lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return result


def assert_same_generation(got: Generation, expected: Generation, tol: float = LOGPROB_TOL):
    assert got.token_ids == expected.token_ids
    assert len(got.logprobs) == len(expected.logprobs)
    assert max(map(abs, _diff(got.logprobs, expected.logprobs)), default=0.0) <= tol
    assert len(got.prompt_logprobs) == len(expected.prompt_logprobs)
    assert max(map(abs, _diff(got.prompt_logprobs, expected.prompt_logprobs)), default=0.0) <= tol


def _diff(a: list[float], b: list[float]) -> list[float]:
    return [x - y for x, y in zip(a, b, strict=True)]
