"""Our runtime with a LoRA slot pool next to the transformers(+peft) oracle, on tiny models.

A `Scenario` runs sequences, each with its own adapter slot (or -1), step by step through
the paged cache: chunked prefill, then one-token decodes until every sequence is done. The
logprob of every token comes back, to compare with a full-sequence forward of the oracle.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adapter_store.format import CanonicalAdapter, model_lora_shapes
from adapter_store.normalize import normalize_peft
from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.kv_pages import PageAllocator, pages_for
from inference_svc.engine.model_runner import ModelRunner, RunnerConfig
from inference_svc.lora.pool import LoraPool, LoraPoolConfig
from inference_svc.model.loader import load_model
from tests.fixtures.tiny_models import build_tiny_model, tiny_config
from tests.normalize.peft_adapters import make_peft_adapter

TOL = 1e-4
PAGE_SIZE = 4
NUM_PAGES = 64
ATTN_Q_LORA = ["q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj"]
ATTN_NO_Q_LORA = ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def peft_case(
    spec: str, rank: int, seed: int, **lora_kwargs
) -> tuple[torch.nn.Module, CanonicalAdapter]:
    """A peft model with random non-zero LoRA on every MLA projection and the routed experts,
    and the same adapter as the store would hand it to the inference service."""
    attn = ATTN_NO_Q_LORA if tiny_config(spec).q_lora_rank is None else ATTN_Q_LORA
    kwargs = dict(r=rank, lora_alpha=2 * rank, target_modules=attn, target_parameters=EXPERTS)
    peft_model, files = make_peft_adapter(spec, seed=seed, **{**kwargs, **lora_kwargs})
    config = peft_model.base_model.model.config.to_dict()
    adapter = normalize_peft(files, config, base_model=spec, max_rank=64)
    return peft_model, adapter


def small_lora_b(adapter: CanonicalAdapter, scale: float) -> CanonicalAdapter:
    """`adapter` with lora_B scaled down, so a random adapter perturbs without swamping."""
    tensors = {
        name: t * scale if name.endswith("lora_B") else t for name, t in adapter.tensors.items()
    }
    return CanonicalAdapter(adapter.manifest, tensors)


@torch.no_grad()
def oracle_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] logprobs of a full-sequence transformers forward."""
    return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def make_runner(
    folder: Path, spec: str, num_slots: int, max_rank: int, device: str = "cpu",
    dtype: torch.dtype = torch.float32, cuda_graph_sizes: tuple[int, ...] = (),
    step_graph_sizes: tuple[int, ...] = (), expert_activations: str = "bf16",
) -> ModelRunner:  # fmt: skip
    """Our model from the checkpoint folder with an empty LoRA pool attached (and decode
    graphs captured for `cuda_graph_sizes`, step graphs for `step_graph_sizes`, if any);
    `expert_activations` as in `load_model` (read where the folder holds FP8 experts)."""
    loaded = load_model(folder, device=device, dtype=dtype, expert_activations=expert_activations)
    shapes = model_lora_shapes(tiny_config(spec).to_dict())
    config = LoraPoolConfig(max_rank, dtype=dtype, device=device, max_loras=num_slots)
    pool = LoraPool(shapes, num_slots, config)
    runner_config = RunnerConfig(
        NUM_PAGES, PAGE_SIZE, cuda_graph_batch_sizes=cuda_graph_sizes,
        step_graph_token_sizes=step_graph_sizes,
    )  # fmt: skip
    runner = ModelRunner(loaded.model, runner_config, pool)
    if cuda_graph_sizes:
        runner.capture_decode_graphs()
    if step_graph_sizes:
        runner.capture_step_graphs()
    return runner


@dataclass
class Seq:
    tokens: list[int]
    slot: int  # LoRA pool slot, -1 = base model
    cached: int = 0
    pages: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # row i predicts token i+1


def random_tokens(lengths: list[int], seed: int, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


class Scenario:
    """Sequences run through `runner` in steps; the page allocator is the scheduler's part."""

    def __init__(self, runner: ModelRunner, seqs: list[Seq]):
        self.runner, self.seqs = runner, seqs
        self.allocator = PageAllocator(NUM_PAGES)
        self.allocator.allocate(3)  # sequences start on non-zero pages

    def step(self, chunks: list[int]) -> None:
        """Run chunks[i] new tokens of seqs[i] (0 = not in this step) as one batch, the
        decodes (chunk 1) first, as the scheduler orders them."""
        steps, ids, members = [], [], []
        order = sorted(range(len(self.seqs)), key=lambda i: chunks[i] != 1)
        for seq, n in ((self.seqs[i], chunks[i]) for i in order):
            if n == 0:
                continue
            total = seq.cached + n
            seq.pages += self.allocator.allocate(pages_for(total, PAGE_SIZE) - len(seq.pages))
            steps.append(SequenceStep(seq.cached, n, tuple(seq.pages), True, seq.slot))
            ids += seq.tokens[seq.cached : total]
            members.append((seq, n))
        device = self.runner.device
        runner = self.runner
        batch = build_batch(
            steps, PAGE_SIZE, device, runner.lora_slot_rank, runner.lora_slot_routed
        )
        logits = self.runner.execute(torch.tensor(ids, device=device), batch)
        row = 0
        for seq, n in members:
            seq.logprobs.extend(logits[row : row + n].log_softmax(-1).cpu())
            seq.cached += n
            row += n

    def run(self, *prefill_chunks: list[int]) -> None:
        """The given prefill steps, then decodes until every sequence is complete."""
        for chunks in prefill_chunks:
            self.step(chunks)
        while any(s.cached < len(s.tokens) for s in self.seqs):
            self.step([int(s.cached < len(s.tokens)) for s in self.seqs])


def max_logprob_diff(seq: Seq, expected: torch.Tensor) -> float:
    return (torch.stack(seq.logprobs) - expected).abs().max().item()


# Prompt chunks, then chunks beside one-token rows on cached context: a mixed step.
PROMPT_THEN_MIXED = ([4, 5, 3, 6, 2], [1, 1, 3, 1, 4])


def assert_runners_agree(
    expected: ModelRunner, checked: ModelRunner, slots: list[int], seed: int, tol: float
) -> None:
    """Five sequences on `slots` (PROMPT_THEN_MIXED, then decodes to the end) through each
    runner: every token's logprobs of `checked` within `tol` of `expected`'s."""
    tokens = random_tokens([9, 12, 7, 10, 11], seed=seed)
    runs = []
    for runner in (expected, checked):
        scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, slots, strict=True)])
        scenario.run(*PROMPT_THEN_MIXED)
        runs.append(scenario.seqs)
    for expected_seq, checked_seq in zip(*runs, strict=True):
        assert len(checked_seq.logprobs) == len(expected_seq.logprobs)
        diff = max_logprob_diff(checked_seq, torch.stack(expected_seq.logprobs))
        assert diff <= tol, f"slot {expected_seq.slot}: {diff:.2e} from the expected runner"


@dataclass(frozen=True)
class SeqKL:
    """Worst token of one sequence: KL(peft fp32 ‖ ours), KL(peft fp32 ‖ peft bf16), and the
    adapter's effect (max |Δlogprob| of the fp32 oracle against the base model)."""

    slot: int
    ours: float
    reference_bf16: float
    effect: float


def scaled_peft_case(
    spec: str, rank: int, seed: int, b_scale: float
) -> tuple[torch.nn.Module, CanonicalAdapter]:
    """`peft_case` with lora_B times `b_scale` in the peft model and the adapter alike."""
    peft_model, adapter = peft_case(spec, rank, seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    return peft_model, small_lora_b(adapter, b_scale)


def kl_per_token(ref: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    """KL(ref ‖ ours) per row of two [L, vocab] logprob tensors."""
    return (ref.exp() * (ref - ours)).sum(dim=-1)


def bf16_kl_scenario(folder: Path, spec: str, device: str, b_scale: float) -> list[SeqKL]:
    """Two adapters (ranks 4 and 16) and the base model share prefill and decode steps of a
    bf16 runner; each sequence's KL against transformers+peft in float32, next to what
    transformers+peft itself loses in bf16 (on the CPU) on the same tokens.

    The random peft adapters have ΔW of 2-4x the base weights at b_scale 1, which makes the
    adapted model ~10x more sensitive to any bf16 rounding (docs/kernel_notes.md §6).
    """
    runner = make_runner(folder, spec, num_slots=4, max_rank=16, device=device,
                         dtype=torch.bfloat16)  # fmt: skip
    cases = [scaled_peft_case(spec, 4, 21, b_scale), scaled_peft_case(spec, 16, 22, b_scale)]
    for slot, (_, adapter) in zip((3, 1), cases, strict=True):
        runner.lora_pool.load(slot, adapter).wait_on()
    tokens = random_tokens([12, 10, 9, 11], seed=23)
    slots = [3, -1, 1, 3]
    scenario = Scenario(runner, [Seq(t, s) for t, s in zip(tokens, slots, strict=True)])
    scenario.run([5, 6, 4, 3], [1, 1, 5, 4])
    base = build_tiny_model(spec)
    oracles = [cases[0][0], base, cases[1][0], cases[0][0]]
    rows = []
    for seq, oracle in zip(scenario.seqs, oracles, strict=True):
        ref = oracle_logprobs(oracle, seq.tokens)  # [L, vocab] float32 on the CPU
        ours = torch.stack(seq.logprobs).float()
        reference_bf16 = oracle_logprobs(copy.deepcopy(oracle).to(torch.bfloat16), seq.tokens)
        effect = (ref - oracle_logprobs(base, seq.tokens)).abs().max().item()
        rows.append(SeqKL(seq.slot, kl_per_token(ref, ours).max().item(),
                          kl_per_token(ref, reference_bf16).max().item(), effect))  # fmt: skip
    return rows
