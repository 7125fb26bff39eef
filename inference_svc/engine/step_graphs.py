"""CUDA graphs of steps that hold prompt tokens: captured in pieces, attention eager between.

An eager step of a 512-token prompt beside running decodes is bound by its launches, not
by its GPU work: on the H200 its ~1280 kernels (with LoRA; ~710 without) keep the GPU busy
~20 ms of a ~100 ms step (docs/benchmarks.md, forty-third and forty-fourth sessions), and
every running request's next token waits for that step. A decode-only step replays a whole
graph; a step with prompts cannot, because its attention follows host counts (the prefill
groups and their context rows, the longest query, the decode rows' page tables). The rest
of a layer follows only the token count.

So a step of T tokens, T ≤ the largest captured size, runs padded to the next captured
size S as L + 1 captured pieces (`DeepseekV3Model.first_piece` / `next_piece`): the
embedding and layer 0's projections; layer i's o projection, FFN and layer i+1's
projections; the last layer's o projection, FFN and the final norm. Between two pieces the
layer's attention runs eagerly on the step's own batch (`MLAAttention.attend`), reading the
queries and writing its output in fixed buffers (`PieceBuffers`), where every piece leaves
its state: one set, sized for the largest S, serves every layer, size and LoRA scope.

Padding rows are token 0 at position 0 writing the scratch page's first row, with no
adapter; the attention never reads them (the step's batch describes rows [0, T)). Sizes
are captured per LoRA scope, as the decode graphs are (`model_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_svc.engine.batch import BatchMetadata
from inference_svc.engine.kv_pages import KVCache
from inference_svc.layers.mla import QueryBuffers
from inference_svc.lora.batch import LoraScope, capture_lora_batch
from inference_svc.lora.pool import LoraPool
from inference_svc.models.deepseek_v3 import DeepseekV3Model, PieceBuffers, PieceState
from kernels.decode_inputs import DecodeInputs, pad_decode_inputs, set_decode_inputs
from kernels.lora_segments import build_lora_segments


def piece_buffers(model: DeepseekV3Model, max_tokens: int) -> PieceBuffers:
    """The fixed state buffers of steps of up to `max_tokens` tokens."""
    c, device, dtype = model.config, model.embed.weight.device, model.dtype
    heads = c.num_heads

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    queries = QueryBuffers(
        q=empty(max_tokens, heads * c.qk_head_dim),
        q_rope=empty(max_tokens, heads, c.qk_rope_head_dim),
        out=empty(max_tokens, heads, c.v_head_dim),
    )
    return PieceBuffers(empty(max_tokens, c.hidden_size), queries)


@dataclass
class _StepGraph:
    """The captured pieces of one size and scope, their static inputs and the states they
    leave (views of the shared buffers; the first piece's RoPE tables its own)."""

    size: int
    inputs: DecodeInputs  # token ids, positions, cache slots (the other two unused)
    batch: BatchMetadata  # what the pieces read: positions, slot_mapping, LoRA segments
    pieces: list[torch.cuda.CUDAGraph]
    states: list[PieceState]


class StepGraphs:
    """Piecewise graphs of steps of up to max(sizes) tokens (see the module docstring)."""

    def __init__(
        self,
        model: DeepseekV3Model,
        kv_cache: KVCache,
        sizes: tuple[int, ...],
        lora_pool: LoraPool | None = None,
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"step graph sizes must be positive, got {sizes}")
        self.model, self.kv_cache, self.lora_pool = model, kv_cache, lora_pool
        self.sizes = tuple(sorted(set(sizes)))
        self.device = model.embed.weight.device
        self.buffers = piece_buffers(model, self.sizes[-1])
        self._graphs: dict[tuple[int, LoraScope], _StepGraph] = {}
        # Source rows of the two inputs a step graph does not use (set_decode_inputs copies
        # five): context lengths and a page table of no columns.
        self._unused_lens = torch.ones(self.sizes[-1], dtype=torch.int32, device=self.device)
        self._no_pages = torch.empty((self.sizes[-1], 0), dtype=torch.int32, device=self.device)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def scopes(self) -> list[LoraScope]:
        """The LoRA scopes captured: as the decode graphs' (`ModelRunner`)."""
        if self.lora_pool is None:
            return [LoraScope.NONE]
        scopes = [LoraScope.NONE, LoraScope.ALL]
        if self.lora_pool.holds_routed_experts:
            scopes.append(LoraScope.NOT_ROUTED)
        return scopes

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size (largest first) and scope into one memory pool."""
        pool = None
        for size in reversed(self.sizes):
            for scope in self.scopes():
                graph = self._capture(size, scope, pool)
                pool = graph.pieces[0].pool()
                self._graphs[size, scope] = graph

    def graph_for(self, batch: BatchMetadata) -> _StepGraph | None:
        """The smallest captured graph of the batch's scope that holds its tokens."""
        if not self._graphs or batch.num_tokens > self.max_tokens:
            return None
        scope = LoraScope.of(batch.lora)
        if scope is LoraScope.NOT_ROUTED and LoraScope.NOT_ROUTED not in self.scopes():
            scope = LoraScope.ALL  # a pool without routed experts: one LoRA graph per size
        size = next(s for s in self.sizes if s >= batch.num_tokens)
        return self._graphs.get((size, scope))

    def run(self, graph: _StepGraph, input_ids: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        """The step's final hidden states [T, hidden]: the pieces replayed, each layer's
        attention run on `batch` between them."""
        n = batch.num_tokens
        step_rows = DecodeInputs(
            input_ids, batch.positions, batch.slot_mapping, self._unused_lens[:n],
            self._no_pages[:n],
        )  # fmt: skip
        set_decode_inputs(graph.inputs, step_rows, self.kv_cache.scratch_page, batch.page_size)
        static_lora = graph.batch.lora
        if static_lora is not None and batch.lora is not None:
            # Rows n.. get slot -1: padding does no LoRA work.
            slot_rank = batch.lora.tokens.slot_rank
            build_lora_segments(batch.lora.token_slots, slot_rank, out=static_lora.tokens)
        graph.pieces[0].replay()
        for i, (layer, state) in enumerate(zip(self.model.layers, graph.states, strict=False)):
            layer.attn.attend(state.queries, batch, self.kv_cache.layer(i))
            graph.pieces[i + 1].replay()
        return graph.states[-1].h[:n]

    def _capture(self, size: int, scope: LoraScope, pool: tuple[int, int] | None) -> _StepGraph:
        inputs, batch = self._static_inputs(size, scope)
        model, kv_cache, buffers = self.model, self.kv_cache, self.buffers
        layers = len(model.layers)
        # Warm up outside the graphs: Triton compiles here. The static batch has no decode
        # rows and no prefill groups, so `attend` has nothing to do while capturing.
        state = model.first_piece(inputs.input_ids, batch, kv_cache, buffers)
        for i in range(layers):
            state = model.next_piece(i, state, batch, kv_cache, buffers)
        torch.cuda.synchronize()
        pieces, states = [], []
        for i in range(layers + 1):
            piece = torch.cuda.CUDAGraph()
            with torch.cuda.graph(piece, pool=pool):
                if i == 0:
                    state = model.first_piece(inputs.input_ids, batch, kv_cache, buffers)
                else:
                    state = model.next_piece(i - 1, state, batch, kv_cache, buffers)
            pool = piece.pool()
            pieces.append(piece)
            states.append(state)
        return _StepGraph(size, inputs, batch, pieces, states)

    def _static_inputs(self, size: int, scope: LoraScope) -> tuple[DecodeInputs, BatchMetadata]:
        """A graph's input buffers, all padding rows, and the batch its pieces read."""
        device = self.device

        def rows(dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        inputs = DecodeInputs(
            rows(torch.int64), rows(torch.int64), rows(torch.int64), rows(torch.int32),
            torch.empty((size, 0), dtype=torch.int32, device=device),
        )  # fmt: skip
        page_size = self.kv_cache.config.page_size
        pad_decode_inputs(inputs, self.kv_cache.scratch_page, page_size)
        lora = None
        if self.lora_pool is not None and scope is not LoraScope.NONE:
            lora = capture_lora_batch(size, self.lora_pool.slot_rank, scope, device)
        # One "prefill sequence" of every row, in no prefill group: the pieces read only the
        # positions, the cache slots and the LoRA segments.
        batch = BatchMetadata(
            positions=inputs.positions,
            query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=device),
            context_lens=inputs.context_lens,
            page_table=inputs.page_table,
            slot_mapping=inputs.slot_mapping,
            logits_indices=torch.empty(0, dtype=torch.int64, device=device),
            num_decode_seqs=0,
            query_lens=(size,),
            context_lens_host=(size,),
            page_size=page_size,
            lora=lora,
        )
        return inputs, batch
