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
LoRA, with LoRA, and with a decode in front (a mixed step); and mixed steps over the
decode-count classes (an online run on the H100 still compiled in steps of 8 and 11
decodes beside a prompt when only one-decode mixed steps were warmed). The decode rows'
contexts span a page table as wide as real ones: the paged decode kernel takes the table's
row stride as an integer argument, which Triton specialises (1, a multiple of 16, other),
so mixed steps run once with each width class (one-page decode contexts left the usual
class cold: the H100 online run then compiled in a step of 8 decodes beside a 512-token
prompt). Combinations of several per-step counts (the MoE alignment's pairs, padded rows and
tiles) cannot be enumerated by step shapes, so those kernels take their counts unspecialised
(`do_not_specialize`; the H100 online run compiled `_moe_align_kernel` in a 520-token step
after every shape above had run). Steps of more than PAIRS_MAX_PAIRS routed pairs run with
LoRA twice, with the routed experts' expand in the grouped GEMM and after it (serving picks
by how many adapters share the step). LoRA rows use a slot whose rank is still 0 (the pool is
empty at start-up): the kernels run, compile and add nothing. The steps write KV rows into
pages no sequence owns yet.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.kv_pages import pages_for
from inference_svc.engine.model_runner import ModelRunner
from inference_svc.lora.apply import moe_lora_placement
from kernels.lora_segments import NO_SLOT
from kernels.moe_lora import PAIRS_MAX_PAIRS

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


def decode_counts(max_decodes: int) -> list[int]:
    """Decode rows of the mixed warm-up steps: 1, 2, 3 and every power of two and the count
    after it (the classes a launcher's batch bucket or Triton's 1 / multiple-of-16 integer
    specialisation can tell apart), up to `max_decodes`."""
    counts = {1, 2, 3}
    power = 4
    while power <= max_decodes:
        counts.update((power, power + 1))
        power *= 2
    return sorted(c for c in counts if c <= max_decodes)


# Prompt tokens beside the decodes of a mixed warm-up step (the prompt's own classes are
# warmed by the prefill steps).
MIXED_PROMPT_TOKENS = 16

# Pages of the decode rows' contexts: one width in Triton's generic integer class and one
# that is a multiple of 16 (a real step's table is as wide as its longest context).
DECODE_PAGE_WIDTHS = (3, 16)


def warm_up_sequences(
    tokens: int, max_model_len: int, page_size: int, decodes: int, width: int, lora_slot: int
):
    """Sequences of one warm-up step: `decodes` decode rows with contexts of `width` pages
    (all on the same pages: they only read them, and their writes land where no sequence
    reads), then `tokens - decodes` prompt tokens in prompts of at most `max_model_len`;
    returns them and the pages used."""
    steps, next_page = [], 0

    def pages(length: int) -> tuple[int, ...]:
        nonlocal next_page
        first, next_page = next_page, next_page + pages_for(length, page_size)
        return tuple(range(first, next_page))

    if decodes:
        context = width * page_size
        shared = pages(context)
        steps += [SequenceStep(context - 1, 1, shared, lora_slot=lora_slot)] * decodes
    tokens -= decodes
    while tokens > 0:
        length = min(tokens, max_model_len)
        steps.append(SequenceStep(0, length, pages(length), lora_slot=lora_slot))
        tokens -= length
    return steps, next_page


def warm_up_shapes(max_tokens: int, max_decodes: int, top_k: int) -> list[tuple[int, int, int]]:
    """(tokens, of which decode rows, decode context pages) of every warm-up step, each run
    without and with LoRA: prefill-only and one-decode steps over the token-count classes,
    then mixed steps over the decode-count classes (a 16-token prompt beside them) at each
    of `DECODE_PAGE_WIDTHS`."""
    narrow = DECODE_PAGE_WIDTHS[0]
    shapes = []
    for tokens in prefill_token_counts(max_tokens, top_k):
        shapes += [(tokens, 0, 0), (tokens, 1, narrow)] if tokens > 1 else [(tokens, 0, 0)]
    for decodes in decode_counts(max_decodes):
        tokens = min(decodes + MIXED_PROMPT_TOKENS, max_tokens)
        for width in DECODE_PAGE_WIDTHS:
            if tokens > decodes and (tokens, decodes, width) not in shapes:
                shapes.append((tokens, decodes, width))
    return shapes


@torch.inference_mode()
def warm_up_prefill(
    runner: ModelRunner, max_tokens: int, max_model_len: int, max_decodes: int = 1
) -> int:
    """Run the warm-up steps (module docstring) on `runner`, with up to `max_decodes`
    decode rows in the mixed ones; returns how many ran. Only worth it on CUDA (the engine
    calls it there); it runs on any device."""
    started = time.monotonic()
    config = runner.model.config
    page_size = runner.config.page_size
    top_k = config.routing.top_k
    ran = 0
    for tokens, decodes, width in warm_up_shapes(max_tokens, max_decodes, top_k):
        for lora_slot, placement in _lora_runs(runner, tokens * top_k):
            steps, pages_used = warm_up_sequences(
                tokens, max_model_len, page_size, decodes, width, lora_slot
            )
            if pages_used > runner.config.num_pages:
                continue  # a step the KV cache could not hold never runs either
            batch = build_batch(steps, page_size, runner.device, runner.lora_slot_rank)
            ids = torch.zeros(tokens, dtype=torch.int64, device=runner.device)
            with moe_lora_placement(placement) if placement else contextlib.nullcontext():
                runner.execute(ids, batch)
            ran += 1
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    log.info("warm-up: %d prefill steps in %.1f s", ran, time.monotonic() - started)
    return ran


def _lora_runs(runner: ModelRunner, num_pairs: int) -> list[tuple[int, str | None]]:
    """(LoRA slot, forced MoE-LoRA placement) of each run of one step shape: the base model,
    and with a LoRA pool the LoRA step, twice where serving may add the routed experts'
    expand in the grouped GEMM or after it (`moe_lora_in_gemm`: it depends on how many
    adapters share the step, which one warm-up slot cannot show)."""
    if runner.lora_pool is None:
        return [(NO_SLOT, None)]
    if num_pairs <= PAIRS_MAX_PAIRS:
        return [(NO_SLOT, None), (0, None)]
    return [(NO_SLOT, None), (0, "always"), (0, "never")]
