"""Paged latent KV cache: step-by-step logprobs equal one full-sequence forward.

Several sequences of uneven lengths, page size 4 (boundaries crossed), chunked prefill
against a cached prefix, and prefill + decode sequences mixed in one flattened step.
"""

from __future__ import annotations

import functools
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


def check_scenario(ckpt, lengths: list[int], first: list[int], second: list[int]) -> None:
    """Step 1 runs `first` tokens per sequence, step 2 `second` (seq 0 must be a decode),
    then one-token decodes until every sequence is done; compare with transformers."""
    loaded = load_model(ckpt.folder)
    runner = ModelRunner(loaded.model, RunnerConfig(num_pages=40, page_size=PAGE_SIZE))
    allocator = PageAllocator(40)
    allocator.allocate(3)  # start the sequences on non-zero, non-contiguous pages
    g = torch.Generator().manual_seed(7)
    seqs = [Seq(torch.randint(0, 256, (n,), generator=g).tolist()) for n in lengths]

    run_step(runner, seqs, first, allocator)
    run_step(runner, seqs, second, allocator)
    while any(s.cached < len(s.tokens) for s in seqs):  # decodes, sequences finish unevenly
        run_step(runner, seqs, [int(s.cached < len(s.tokens)) for s in seqs], allocator)

    for seq in seqs:
        ours = torch.stack(seq.logprobs)
        ref = ckpt.hf_logprobs(seq.tokens)
        diff = (ours - ref).abs().max().item()
        assert diff <= TOL, f"{ckpt.name}: max |Δlogprob| {diff:.2e} over {len(seq.tokens)} tokens"
    assert sum(len(s.pages) for s in seqs) == 40 - 3 - allocator.num_free


@pytest.mark.parametrize("spec", ["v3_q_lora", "v3_yarn", "v2_greedy"])
def test_stepwise_decode_matches_full_forward(spec, tiny_checkpoint):
    # A prefills 7 then decodes; B prefills in chunks of 8 and 4 (the second on a cached
    # prefix, in the same step as A's decode and C's prefill); lengths end unevenly.
    check_scenario(tiny_checkpoint(spec), [14, 19, 9], [7, 8, 0], [1, 4, 3])


@pytest.mark.parametrize("mla_variant", ["v2", "v3"])
def test_triton_kernels_in_the_model_match_transformers(tiny_checkpoint, monkeypatch, mla_variant):
    """The same scenario with the CPU path routed through the Triton launchers (interpreted
    on CPU): checks the kernels' integration (strides, slicing, padding) end to end."""
    from inference_svc.layers import mla as mla_layer
    from kernels import fp8, mla_attention, mla_prefill
    from kernels import fused_moe as fm

    decode = functools.partial(mla_attention.mla_decode, variant=mla_variant)
    monkeypatch.setattr(mla_layer, "mla_decode_ref", decode)
    monkeypatch.setattr(mla_layer, "mla_prefill_varlen_ref", mla_prefill.mla_prefill_varlen)
    for name in ("grouped_gemm", "silu_mul", "moe_combine"):
        monkeypatch.setattr(fm, f"{name}_ref", getattr(fm, name))
    monkeypatch.setattr(fp8, "fp8_block_linear_ref", fp8.fp8_block_linear)
    check_scenario(tiny_checkpoint("v3_q_lora"), [8, 11, 6], [5, 6, 0], [1, 5, 3])
