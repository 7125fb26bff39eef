"""Runs one step of the model: flattened batch in, logits of the requested rows out.

Owns the latent KV cache tensors (the scheduler owns the page allocator) and, on CUDA,
CUDA graphs of the decode step for a set of batch sizes: a decode-only batch of B ≤ the
largest captured size is padded to the next captured size and replayed.

With a LoRA slot pool, each size is captured twice: without LoRA (steps in which no
sequence uses an adapter do no LoRA work) and with it; on an MoE model a third time, with
LoRA everywhere but the routed experts, for steps none of whose adapters targets them
(`LoraBatch.routed_experts`: most MoE fine-tunes leave the experts alone). A LoRA graph
owns fixed-size segment buffers that each replay rewrites in place; its kernels were
captured with grids sized from the buffers' capacity, so a replay may hold any mix of
adapters.

Steps with prompt tokens (and decode-only steps past the largest decode graph) of up to
the largest `step_graph_token_sizes` replay piecewise graphs instead, each layer's
attention eager between two pieces (`step_graphs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference_svc.engine.batch import BatchMetadata
from inference_svc.engine.kv_pages import KVCache, KVCacheConfig
from inference_svc.engine.step_graphs import StepGraphs
from inference_svc.lora.attach import attach_lora_pool
from inference_svc.lora.batch import LoraScope, capture_lora_batch
from inference_svc.lora.pool import LoraPool
from inference_svc.models.deepseek_v3 import DeepseekV3Model
from kernels.decode_inputs import DecodeInputs, pad_decode_inputs, set_decode_inputs
from kernels.lora_segments import build_lora_segments


@dataclass(frozen=True)
class RunnerConfig:
    num_pages: int
    page_size: int = 16
    max_pages_per_seq: int = 256  # page-table width of captured graphs
    cuda_graph_batch_sizes: tuple[int, ...] = field(default=(1, 2, 4, 8, 16, 32, 64, 128, 256))
    # Token counts of the piecewise step graphs (steps with prompt tokens, `step_graphs`);
    # empty: such steps run eagerly.
    step_graph_token_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_pages <= 0 or self.page_size <= 0 or self.max_pages_per_seq <= 0:
            raise ValueError("num_pages, page_size and max_pages_per_seq must be > 0")
        if any(b <= 0 for b in (*self.cuda_graph_batch_sizes, *self.step_graph_token_sizes)):
            raise ValueError("cuda_graph_batch_sizes and step_graph_token_sizes must be positive")


@dataclass
class _DecodeGraph:
    """A captured decode step of `size` sequences and its static inputs/outputs."""

    size: int
    graph: torch.cuda.CUDAGraph
    inputs: DecodeInputs  # the static token ids and the batch's per-row tensors
    batch: BatchMetadata
    logits: torch.Tensor  # [size, vocab] in the model's dtype: lm_head's output


class ModelRunner:
    def __init__(
        self, model: DeepseekV3Model, config: RunnerConfig, lora_pool: LoraPool | None = None
    ):
        self.model = model
        self.config = config
        device = model.embed.weight.device
        self.device = device
        c = model.config
        self.kv_cache = KVCache(
            KVCacheConfig(c.num_layers, config.num_pages, config.page_size, c.kv_cache_dim),
            model.dtype,
            device,
        )
        self.lora_pool = lora_pool
        if lora_pool is not None:
            attach_lora_pool(model, lora_pool)
        # The LoRA scopes the decode and step graphs are captured in.
        self.graph_scopes = LoraScope.captured(
            None if lora_pool is None else lora_pool.holds_routed_experts
        )
        self._graphs: dict[tuple[int, LoraScope], _DecodeGraph] = {}  # by (size, scope)
        self.step_graphs: StepGraphs | None = None
        # Steps with prompt tokens replay the step graphs while this holds (benchmarks
        # alternate it step by step against the eager path).
        self.use_step_graphs = True

    @property
    def lora_slot_rank(self) -> torch.Tensor | None:
        """The pool's per-slot ranks, for `build_batch` (None without a pool)."""
        return None if self.lora_pool is None else self.lora_pool.slot_rank

    @property
    def lora_slot_routed(self) -> list[bool] | None:
        """The pool's per-slot "targets the routed experts", for `build_batch`."""
        return None if self.lora_pool is None else self.lora_pool.slot_routed_host

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        """input_ids [T] of `batch` → float32 logits [len(batch.logits_indices), vocab]."""
        graph = self._graph_for(batch)
        if graph is not None:
            return self._replay(graph, input_ids, batch)
        pieces = self.step_graphs
        step_graph = pieces.graph_for(batch) if pieces and self.use_step_graphs else None
        if step_graph is not None:
            hidden = pieces.run(step_graph, input_ids, batch)
        else:
            hidden = self.model(input_ids, batch, self.kv_cache)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def _graph_for(self, batch: BatchMetadata) -> _DecodeGraph | None:
        decode_only = batch.num_decode_seqs == batch.num_seqs
        if not self._graphs or not decode_only:
            return None
        if batch.page_table.shape[1] > self.config.max_pages_per_seq:
            return None
        scope = LoraScope.serving(batch.lora, self.graph_scopes)
        fitting = [s for s, k in self._graphs if k is scope and s >= batch.num_seqs]
        return self._graphs[min(fitting), scope] if fitting else None

    def _static_decode_batch(
        self, size: int, scope: LoraScope
    ) -> tuple[DecodeInputs, BatchMetadata]:
        """Inputs of a padding-only decode batch: token 0 at position 0 with one cached token,
        every row reading/writing the scratch page."""
        device = self.device
        batch = BatchMetadata(
            positions=torch.empty(size, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            context_lens=torch.empty(size, dtype=torch.int32, device=device),
            page_table=torch.empty(
                (size, self.config.max_pages_per_seq), dtype=torch.int32, device=device
            ),
            slot_mapping=torch.empty(size, dtype=torch.int64, device=device),
            logits_indices=torch.arange(size, dtype=torch.int64, device=device),
            num_decode_seqs=size,
            query_lens=(1,) * size,
            context_lens_host=(1,) * size,
            page_size=self.config.page_size,
            lora=capture_lora_batch(size, self.lora_slot_rank, scope, device),
        )
        inputs = _decode_inputs(torch.empty(size, dtype=torch.int64, device=device), batch)
        pad_decode_inputs(inputs, self.kv_cache.scratch_page, self.config.page_size)
        return inputs, batch

    @torch.inference_mode()
    def capture_decode_graphs(self) -> None:
        """Capture the decode step for each configured batch size (CUDA only)."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a CUDA device")
        pool = None
        for size in sorted(self.config.cuda_graph_batch_sizes, reverse=True):
            for scope in self.graph_scopes:
                inputs, batch = self._static_decode_batch(size, scope)
                # Warm up outside the graph: Triton compiles and autotunes here.
                self.model.compute_logits(self.model(inputs.input_ids, batch, self.kv_cache))
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self.model(inputs.input_ids, batch, self.kv_cache)
                    logits = self.model.lm_head(hidden)
                pool = graph.pool()
                self._graphs[size, scope] = _DecodeGraph(size, graph, inputs, batch, logits)

    @torch.inference_mode()
    def capture_step_graphs(self) -> None:
        """Capture the piecewise graphs of steps with prompt tokens, for each configured
        token count (CUDA only; `step_graphs`)."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a CUDA device")
        sizes = self.config.step_graph_token_sizes
        if sizes:
            self.step_graphs = StepGraphs(
                self.model, self.kv_cache, sizes, self.lora_pool, self.graph_scopes
            )
            self.step_graphs.capture()

    def release_decode_graphs(self) -> None:
        """Drop the captured graphs, the step graphs too (and their memory pools), so they
        can be captured anew."""
        self._graphs.clear()
        self.step_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _replay(self, g: _DecodeGraph, input_ids: torch.Tensor, batch: BatchMetadata):
        n, static = batch.num_seqs, g.batch
        # The step's rows and the padding rows past them in one launch; the page table's
        # columns past the batch's keep what they held (no kernel reads a page entry past
        # its sequence's context: the decode kernels mask those loads).
        set_decode_inputs(
            g.inputs, _decode_inputs(input_ids, batch), self.kv_cache.scratch_page,
            self.config.page_size,
        )  # fmt: skip
        if static.lora is not None and batch.lora is not None:
            # Rows n.. of the graph's batch get slot -1: padding does no LoRA work.
            slot_rank = batch.lora.tokens.slot_rank
            build_lora_segments(batch.lora.token_slots, slot_rank, out=static.lora.tokens)
        g.graph.replay()
        # A decode-only batch wants the logits of every row, in order (logits_indices is
        # arange(n)), so no gather: the float32 conversion is the one launch after the
        # replay, and it returns a new tensor, as the eager path does, that the next replay
        # leaves alone.
        return g.logits[:n].to(torch.float32, copy=True)


def _decode_inputs(input_ids: torch.Tensor, batch: BatchMetadata) -> DecodeInputs:
    return DecodeInputs(
        input_ids, batch.positions, batch.slot_mapping, batch.context_lens, batch.page_table
    )
