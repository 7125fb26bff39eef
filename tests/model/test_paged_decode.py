"""Paged latent KV cache: step-by-step logprobs equal one full-sequence forward.

Several sequences of uneven lengths, page size 4 (boundaries crossed), chunked prefill
against a cached prefix, and prefill + decode sequences mixed in one flattened step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.kv_pages import PageAllocator, pages_for
from inference_svc.engine.model_runner import ModelRunner, RunnerConfig
from inference_svc.model.loader import load_model

TOL = 1e-4
PAGE_SIZE = 4


@dataclass
class Seq:
    tokens: list[int]  # the whole sequence, fed by teacher forcing
    cached: int = 0
    pages: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # row i predicts token i+1


def plan_step(seqs: list[Seq], chunks: list[int], allocator: PageAllocator):
    """SequenceSteps and input ids for `chunks[i]` new tokens of seqs[i] (0 = skip)."""
    steps, ids, members = [], [], []
    for seq, n in zip(seqs, chunks, strict=True):
        if n == 0:
            continue
        total = seq.cached + n
        seq.pages += allocator.allocate(pages_for(total, PAGE_SIZE) - len(seq.pages))
        steps.append(SequenceStep(seq.cached, n, tuple(seq.pages), all_logits=True))
        ids += seq.tokens[seq.cached : total]
        members.append((seq, n))
    return steps, torch.tensor(ids), members


def run_step(runner, seqs, chunks, allocator):
    steps, ids, members = plan_step(seqs, chunks, allocator)
    logits = runner.execute(ids, build_batch(steps, PAGE_SIZE, "cpu")).log_softmax(-1)
    row = 0
    for seq, n in members:
        seq.logprobs.extend(logits[row : row + n])
        seq.cached += n
        row += n


@pytest.mark.parametrize("spec", ["v3_q_lora", "v3_yarn", "v2_greedy"])
def test_stepwise_decode_matches_full_forward(spec, tiny_checkpoint):
    ckpt = tiny_checkpoint(spec)
    loaded = load_model(ckpt.folder)
    runner = ModelRunner(loaded.model, RunnerConfig(num_pages=40, page_size=PAGE_SIZE))
    allocator = PageAllocator(40)
    allocator.allocate(3)  # start the sequences on non-zero, non-contiguous pages
    g = torch.Generator().manual_seed(7)
    lengths = [14, 19, 9]
    seqs = [Seq(torch.randint(0, 256, (n,), generator=g).tolist()) for n in lengths]

    run_step(runner, seqs, [7, 8, 0], allocator)  # A prefill, B first chunk
    run_step(runner, seqs, [1, 4, 3], allocator)  # A decodes; B chunk on a cached prefix; C
    while any(s.cached < len(s.tokens) for s in seqs):  # decodes, sequences finish unevenly
        run_step(runner, seqs, [int(s.cached < len(s.tokens)) for s in seqs], allocator)

    for seq in seqs:
        ours = torch.stack(seq.logprobs)
        ref = ckpt.hf_logprobs(seq.tokens)
        diff = (ours - ref).abs().max().item()
        assert diff <= TOL, f"{spec}: max |Δlogprob| {diff:.2e} over {len(seq.tokens)} tokens"
    assert sum(len(s.pages) for s in seqs) == 40 - 3 - allocator.num_free
