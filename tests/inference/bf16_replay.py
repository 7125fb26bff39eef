"""The engine's steps replayed through a model runner, and the runner's bf16 routing held
against transformers+peft in float32 (tests/model/bf16_parity.py's near-tie rule, with
adapters).

A `Schedule` keeps only the batch composition of each engine step: which requests, how
many new tokens each, whether all their logits were kept. `replay` rebuilds every step on
its own (cached lengths from its own counters, tokens from the finished sequences, pages
from its own allocator, LoRA slots from its own adapter → slot map), so the engine's
bookkeeping is checked, not copied. With the same composition and kernels, a replay on the
CPU gives the engine's rows bit for bit.

While replaying, the inputs of our routers are recorded per request and position (hooks do
not fire inside CUDA-graph replays: record with graphs released). The peft model with the
request's adapter active is the oracle: its router scores come from hooks on its gates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.kv_pages import PageAllocator, pages_for
from inference_svc.engine.model_runner import ModelRunner
from inference_svc.engine.sequence import Sequence
from inference_svc.model.config import RoutingConfig
from tests.model.bf16_parity import (
    NearTieReport,
    assert_near_tie_rule,
    kl_per_token,
    record_router_inputs,
    routing_flips,
)


@dataclass(frozen=True)
class StepShare:
    """One request's part of an engine step."""

    request_id: str
    query_len: int
    all_logits: bool


Schedule = list[list[StepShare]]  # per engine step, in the engine's (decodes-first) order


@dataclass
class Replay:
    """Per request: the logits rows the runner gave ([rows, V] float32, position order) and,
    per MoE layer, the router inputs of the tokens run ([tokens, hidden] float32)."""

    rows: dict[str, Tensor] = field(default_factory=dict)
    router_inputs: dict[str, list[Tensor]] = field(default_factory=dict)


def moe_routers(runner: ModelRunner) -> list[torch.nn.Module]:
    return [layer.moe.gate for layer in runner.model.layers if layer.moe is not None]


def peft_routers(peft_model) -> list[torch.nn.Module]:
    layers = peft_model.get_base_model().model.layers
    return [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "gate")]


def replay(
    runner: ModelRunner, seqs: list[Sequence], schedule: Schedule, slots: dict[str, int]
) -> Replay:
    """Run `schedule` on `runner` for the finished `seqs`; `slots` maps an adapter name to
    the runner pool's slot holding it (base requests: no entry)."""
    by_id = {s.request_id: s for s in seqs}
    tokens = {s.request_id: s.prompt_token_ids + s.output_token_ids for s in seqs}
    cached = dict.fromkeys(by_id, 0)
    pages: dict[str, list[int]] = {rid: [] for rid in by_id}
    allocator = PageAllocator(runner.config.num_pages)
    page_size = runner.config.page_size
    routers = moe_routers(runner)
    seen, handles = record_router_inputs(routers)
    rows: dict[str, list[Tensor]] = {rid: [] for rid in by_id}
    inputs: dict[str, list[list[Tensor]]] = {rid: [[] for _ in routers] for rid in by_id}
    try:
        for step in schedule:
            steps, ids = [], []
            for share in step:
                rid, start = share.request_id, cached[share.request_id]
                end = start + share.query_len
                pages[rid] += allocator.allocate(pages_for(end, page_size) - len(pages[rid]))
                adapter = by_id[rid].adapter
                slot = -1 if adapter is None else slots[adapter.name]
                steps.append(SequenceStep(start, share.query_len, tuple(pages[rid]),
                                          share.all_logits, slot))  # fmt: skip
                ids += tokens[rid][start:end]
            batch = build_batch(steps, page_size, runner.device, runner.lora_slot_rank)
            for layer in seen:
                layer.clear()
            logits = runner.execute(torch.tensor(ids, device=runner.device), batch)
            row = token = 0
            for share in step:
                n = share.query_len if share.all_logits else 1
                rows[share.request_id].append(logits[row : row + n].float().cpu())
                for layer, got in zip(inputs[share.request_id], seen, strict=True):
                    if got:  # empty inside a CUDA-graph replay
                        layer.append(got[0][token : token + share.query_len])
                row += n
                token += share.query_len
                cached[share.request_id] += share.query_len
    finally:
        for handle in handles:
            handle.remove()
    result = Replay()
    for rid in by_id:
        result.rows[rid] = torch.cat(rows[rid])
        if all(inputs[rid]):
            result.router_inputs[rid] = [torch.cat(layer) for layer in inputs[rid]]
    return result


@torch.no_grad()
def oracle_trace(peft_model, adapter: str, ids: list[int]) -> tuple[Tensor, list[Tensor]]:
    """The peft model (fp32) on `ids` with `adapter` ("" = base): logprobs [L, V] and, per
    MoE layer, its router inputs [L, hidden]."""
    routers = peft_routers(peft_model)
    seen, handles = record_router_inputs(routers)
    try:
        if adapter:
            peft_model.set_adapter(adapter)
            logits = peft_model(torch.tensor([ids])).logits[0]
        else:
            with peft_model.disable_adapter():
                logits = peft_model(torch.tensor([ids])).logits[0]
    finally:
        for handle in handles:
            handle.remove()
    return logits.float().log_softmax(-1), [torch.cat(layer) for layer in seen]


def check_replay_against_peft(
    replayed: Replay, seqs: list[Sequence], runner: ModelRunner, peft_model,
    routing: RoutingConfig,
) -> dict[str, NearTieReport]:  # fmt: skip
    """The near-tie rule of tests/model/bf16_parity.py for each request, our bf16 rows and
    routing against the peft model with that request's adapter in float32."""
    reports = {}
    for seq in seqs:
        rid = seq.request_id
        ours = replayed.rows[rid].log_softmax(-1)  # [N, V]: every position run
        n = ours.shape[0]
        adapter = "" if seq.adapter is None else seq.adapter.name
        ref, ref_inputs = oracle_trace(peft_model, adapter, seq.prompt_token_ids + seq.output_token_ids)
        report = routing_flips(
            moe_routers(runner), [x[:n] for x in replayed.router_inputs[rid]],
            peft_routers(peft_model), [x[:n] for x in ref_inputs], routing,
        )  # fmt: skip
        report.kl = kl_per_token(ref[:n], ours)
        reports[rid] = report
    return reports


def assert_replay_near_tie_rule(reports: dict[str, NearTieReport]) -> None:
    for rid, report in reports.items():
        assert_near_tie_rule(report, rid)
