"""Start-up warm-up: compile the kernels of every prefill shape class before serving.

Triton compiles (and autotunes) a kernel the first time it sees a new set of compile-time
constants, and several launchers derive theirs from the step's size: the MoE alignment's
pair tile (next power of two of T·k), the MoE row tile, the split-K plan of the LoRA
shrinks, the FP8 GEMM tiles. Decode steps are covered by the CUDA-graph capture (every
captured batch size runs once before it is captured), prefill steps were not: the first
request whose step landed in a new class stalled every running request for the seconds a
compile takes (the offline benchmark's first scenario spent 8 s more in prefill steps than
the same scenario later in the process).

So, on CUDA, one eager step per token count that can start a new class — every power of
two, and every count whose T·k crosses one — up to the step's token budget, each without
LoRA, with LoRA, and with a decode in front (a mixed step). LoRA rows use a slot whose rank
is still 0 (the pool is empty at start-up): the kernels run, compile and add nothing. The
steps write KV rows into pages no sequence owns yet.
"""

from __future__ import annotations

import logging
import time

import torch

from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.kv_pages import pages_for
from inference_svc.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


def prefill_token_counts(max_tokens: int, top_k: int) -> list[int]:
    """Token counts whose steps may compile new kernel variants: powers of two, the
    smallest counts whose T·top_k reaches a power of two, and `max_tokens` itself."""
    counts = {max_tokens}
    power = 1
    while power <= max_tokens * top_k:
        counts.add(power)
        counts.add(-(-power // top_k))
        power *= 2
    return sorted(c for c in counts if 1 <= c <= max_tokens)


def _steps(tokens: int, max_model_len: int, page_size: int, decode: bool, lora_slot: int):
    """Sequences of one warm-up step: `tokens` prompt tokens in prompts of at most
    `max_model_len`, on consecutive fresh pages; with `decode`, one decode row in front."""
    steps, next_page = [], 0

    def pages(length: int) -> tuple[int, ...]:
        nonlocal next_page
        first, next_page = next_page, next_page + pages_for(length, page_size)
        return tuple(range(first, next_page))

    if decode:
        steps.append(SequenceStep(1, 1, pages(2), lora_slot=lora_slot))
        tokens -= 1
    while tokens > 0:
        length = min(tokens, max_model_len)
        steps.append(SequenceStep(0, length, pages(length), lora_slot=lora_slot))
        tokens -= length
    return steps, next_page


@torch.inference_mode()
def warm_up_prefill(runner: ModelRunner, max_tokens: int, max_model_len: int) -> int:
    """Run the warm-up steps (module docstring) on `runner`; returns how many ran. Only
    worth it on CUDA (the engine calls it there); it runs on any device."""
    started = time.monotonic()
    config = runner.model.config
    page_size = runner.config.page_size
    lora_slots = [-1] if runner.lora_pool is None else [-1, 0]
    ran = 0
    for tokens in prefill_token_counts(max_tokens, config.routing.top_k):
        for lora_slot in lora_slots:
            for decode in (False, True) if tokens > 1 else (False,):
                steps, pages_used = _steps(tokens, max_model_len, page_size, decode, lora_slot)
                if pages_used > runner.config.num_pages:
                    continue  # a step the KV cache could not hold never runs either
                batch = build_batch(steps, page_size, runner.device, runner.lora_slot_rank)
                ids = torch.zeros(tokens, dtype=torch.int64, device=runner.device)
                runner.execute(ids, batch)
                ran += 1
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    log.info("warm-up: %d prefill steps in %.1f s", ran, time.monotonic() - started)
    return ran
