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
    KL_BOUND,
    MAX_FLIP_FRACTION,
    NearTieReport,
    kl_per_token,
    record_router_inputs,
    route,
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


def forced_routing(routers: list[torch.nn.Module], forced: dict[int, dict[int, Tensor]]):
    """Hooks that make transformers' DeepseekV3 routers pick, at layer i and token t, the
    experts `forced[i][t]` [k] (weights recomputed from the router's own scores, as it
    would for that choice); returns the hook handles."""

    def hook(router, args, out, layer):
        logits, weights, ids = out  # [N, E], [N, k], [N, k]
        if not forced.get(layer):
            return out
        ids = ids.clone()
        for token, experts in forced[layer].items():
            ids[token] = experts
        weights = logits.sigmoid().gather(1, ids)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * router.routed_scaling_factor, ids

    return [
        router.register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i))
        for i, router in enumerate(routers)
    ]


@torch.no_grad()
def oracle_trace(
    peft_model, adapter: str, ids: list[int], forced: dict[int, dict[int, Tensor]] | None = None
) -> tuple[Tensor, list[Tensor]]:
    """The peft model (fp32) on `ids` with `adapter` ("" = base), its routing overridden
    where `forced` says: logprobs [L, V] and, per MoE layer, its router inputs [L, hidden]."""
    routers = peft_routers(peft_model)
    seen, handles = record_router_inputs(routers)
    handles += forced_routing(routers, forced or {})
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


# A flip changes the token's later layers, and every later token attends to them: the
# oracle follows each excused flip, so a few rounds settle (each adds flips or stops).
MAX_ROUNDS = 8


def check_seq_against_peft(
    peft_model, seq: Sequence, ours_logprobs: Tensor, ours_x: list[Tensor],
    runner: ModelRunner, routing: RoutingConfig,
) -> NearTieReport:  # fmt: skip
    """Our bf16 run of `seq` against the peft model with its adapter in float32.

    Where our selection differs from the oracle's at a near-tie, the oracle is made to take
    ours (that layer and token) and re-run; a difference that is not a near-tie fails.
    When the routing agrees everywhere, every token must meet KL_BOUND: this holds the
    flipped tokens and everything after them to the bound, against the oracle that routed
    as we did. Returns the last round's report (flipped: every forced token)."""
    n = ours_logprobs.shape[0]
    adapter = "" if seq.adapter is None else seq.adapter.name
    ids = seq.prompt_token_ids + seq.output_token_ids
    ours_routers, ref_routers = moe_routers(runner), peft_routers(peft_model)
    forced: dict[int, dict[int, Tensor]] = {}
    for _ in range(MAX_ROUNDS):
        ref, ref_x = oracle_trace(peft_model, adapter, ids, forced)
        new_flips = False
        for layer, (ours_router, x, ref_router, x_ref) in enumerate(
            zip(ours_routers, ours_x, ref_routers, ref_x, strict=True)
        ):
            report = routing_flips([ours_router], [x[:n]], [ref_router], [x_ref[:n]], routing)
            bugs = (report.flipped & ~report.near_tie).nonzero().flatten().tolist()
            assert not bugs, (
                f"{seq.request_id} layer {layer}: routing differs from the oracle at tokens "
                f"{bugs} whose fp32 margins exceed the bf16 perturbation: a routing bug\n"
                + "\n".join(report.describe(t) for t in bugs)
            )
            bias = getattr(ref_router, "e_score_correction_bias", None)
            got = route(x[:n] @ ours_router.weight.detach().float().cpu().T, routing, bias)
            # `report` ranks the oracle's own scores, so forced tokens still show as flips.
            layer_forced = forced.setdefault(layer, {})
            for token in report.flipped.nonzero().flatten().tolist():
                if token not in layer_forced:
                    layer_forced[token] = got.ids[token]
                    new_flips = True
        if not new_flips:
            break
    else:
        raise AssertionError(f"{seq.request_id}: routing still differs after {MAX_ROUNDS} rounds")
    report = routing_flips(ours_routers, [x[:n] for x in ours_x],
                           ref_routers, [x[:n] for x in ref_x], routing)  # fmt: skip
    report.flipped = torch.zeros(n, dtype=torch.bool)
    for tokens in forced.values():
        report.flipped[list(tokens)] = True
    report.kl = kl_per_token(ref[:n], ours_logprobs)
    return report


def check_replay_against_peft(
    replayed: Replay, seqs: list[Sequence], runner: ModelRunner, peft_model,
    routing: RoutingConfig,
) -> dict[str, NearTieReport]:  # fmt: skip
    """`check_seq_against_peft` for each request of a replay."""
    return {
        seq.request_id: check_seq_against_peft(
            peft_model,
            seq,
            replayed.rows[seq.request_id].log_softmax(-1),
            replayed.router_inputs[seq.request_id],
            runner,
            routing,
        )  # fmt: skip
        for seq in seqs
    }


# One bf16 run is one draw of rounding errors, and a few ill-conditioned tokens land above KL_BOUND
# in most correct draws: over 12 one-ulp re-roundings (tests/inference/bf16_spread.py) the per-token
# bound failed for 8/12 of ours and 9/12 of transformers+peft's own bf16 run, whose worst tokens
# reached 4.6e-3 (ours) and 3.4e-3 (peft); 11/12 of both on 2026-11-26. Even float32 between the
# GEMMs with a bf16 latent cache fails 2/12 (docs/kernel_notes.md). So the bound is held where a
# correct bf16 run holds it whatever the draw: by most tokens, by each request's mean, and by every
# token within WORST_TOKEN_KL (a wrong delta, scale or routing lands far above it).
MIN_TOKENS_WITHIN_BOUND = 0.9
WORST_TOKEN_KL = 1e-2


def assert_replay_parity(reports: dict[str, NearTieReport]) -> None:
    """Against the oracle that routed as we did: at least MIN_TOKENS_WITHIN_BOUND of all
    tokens and each request's mean within KL_BOUND, every token within WORST_TOKEN_KL, and
    near-tie flips rare (≤ MAX_FLIP_FRACTION of all tokens)."""
    for rid, report in reports.items():
        worst = int(report.kl.argmax())
        assert report.kl[worst] <= WORST_TOKEN_KL, f"{rid}: {report.describe(worst)}"
        assert report.kl.mean() <= KL_BOUND, f"{rid}: mean KL {report.kl.mean():.2e}"
    kl = torch.cat([r.kl for r in reports.values()])
    within = float((kl <= KL_BOUND).float().mean())
    assert within >= MIN_TOKENS_WITHIN_BOUND, (
        f"only {within:.0%} of {len(kl)} tokens within KL {KL_BOUND:g}; worst per request: "
        + ", ".join(f"{rid} {r.describe(int(r.kl.argmax()))}" for rid, r in reports.items())
    )
    flips = sum(int(r.flipped.sum()) for r in reports.values())
    assert flips <= MAX_FLIP_FRACTION * len(kl), f"{flips} of {len(kl)} tokens flipped at near-ties"
