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
from kernels.decode_inputs import DecodeInputs, set_decode_inputs, set_decode_inputs_ref
from kernels.lora_segments import NO_SLOT, build_lora_segments


def piece_buffers(model: DeepseekV3Model, max_tokens: int) -> PieceBuffers:
    """The fixed state buffers of steps of up to `max_tokens` tokens."""
    c, device, dtype = model.config, model.embed.weight.device, model.dtype
    heads = c.num_heads

    # Zeros, not garbage: rows past a step keep finite values, which the padding rows'
    # projections and experts then compute on.
    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    queries = QueryBuffers(
        q=zeros(max_tokens, heads * c.qk_head_dim),
        q_rope=zeros(max_tokens, heads, c.qk_rope_head_dim),
        out=zeros(max_tokens, heads, c.v_head_dim),
    )
    return PieceBuffers(zeros(max_tokens, c.hidden_size), queries)


class PaddedStep:
    """A step graph's static inputs: token ids, positions and cache slots of `size` rows,
    and the batch its pieces read (those, and the LoRA segments of `scope`). `load` puts a
    step of up to `size` tokens in, the rows past it padding."""

    def __init__(
        self,
        size: int,
        scope: LoraScope,
        kv_cache: KVCache,
        lora_pool: LoraPool | None,
        device: torch.device,
    ) -> None:
        self.size, self.kv_cache = size, kv_cache

        def rows(dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        # set_decode_inputs copies five fields; a step graph uses three. The other two are
        # context lengths and a page table of no columns, from these unused source rows.
        self._unused_lens = torch.ones(size, dtype=torch.int32, device=device)
        self._no_pages = torch.empty((size, 0), dtype=torch.int32, device=device)
        self.inputs = DecodeInputs(
            rows(torch.int64), rows(torch.int64), rows(torch.int64), rows(torch.int32),
            torch.empty((size, 0), dtype=torch.int32, device=device),
        )  # fmt: skip
        self._set = set_decode_inputs if device.type == "cuda" else set_decode_inputs_ref
        page_size = kv_cache.config.page_size
        none = self.inputs.input_ids[:0]  # every row padding until the first load
        self._set(self.inputs, self._rows(none, none, none), kv_cache.scratch_page, page_size)
        slot_rank = None if lora_pool is None else lora_pool.slot_rank
        lora = capture_lora_batch(size, slot_rank, scope, device)
        # One "prefill sequence" of every row, in no prefill group: the pieces read only the
        # positions, the cache slots and the LoRA segments, and `attend` on this batch has
        # nothing to do.
        self.batch = BatchMetadata(
            positions=self.inputs.positions,
            query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=device),
            context_lens=self.inputs.context_lens,
            page_table=self.inputs.page_table,
            slot_mapping=self.inputs.slot_mapping,
            logits_indices=torch.empty(0, dtype=torch.int64, device=device),
            num_decode_seqs=0,
            query_lens=(size,),
            context_lens_host=(size,),
            page_size=page_size,
            lora=lora,
        )

    def load(self, input_ids: torch.Tensor, batch: BatchMetadata) -> None:
        """Rows [0, T) take the step's token ids, positions and cache slots; rows past it
        are token 0 at position 0 writing the scratch page's first row with no adapter."""
        rows = self._rows(input_ids, batch.positions, batch.slot_mapping)
        self._set(self.inputs, rows, self.kv_cache.scratch_page, batch.page_size)
        static_lora = self.batch.lora
        if static_lora is not None and batch.lora is not None:
            # The segments describe every row the pieces run, as at the capture.
            padding = (NO_SLOT,) * (self.size - batch.num_tokens)
            slots = batch.lora.token_slots + padding
            build_lora_segments(slots, batch.lora.tokens.slot_rank, out=static_lora.tokens)

    def _rows(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor
    ) -> DecodeInputs:
        n = input_ids.shape[0]
        return DecodeInputs(
            input_ids, positions, slot_mapping, self._unused_lens[:n], self._no_pages[:n]
        )


@dataclass
class _StepGraph:
    """The captured pieces of one size and scope, their static inputs and the states they
    leave (views of the shared buffers; the first piece's RoPE tables its own)."""

    step: PaddedStep
    pieces: list[torch.cuda.CUDAGraph]
    states: list[PieceState]

    @property
    def size(self) -> int:
        return self.step.size


class StepGraphs:
    """Piecewise graphs of steps of up to max(sizes) tokens (see the module docstring)."""

    def __init__(
        self,
        model: DeepseekV3Model,
        kv_cache: KVCache,
        sizes: tuple[int, ...],
        lora_pool: LoraPool | None,
        scopes: tuple[LoraScope, ...],
    ) -> None:
        """`scopes`: the LoRA scopes to capture (`ModelRunner.graph_scopes`)."""
        if not sizes or min(sizes) < 1:
            raise ValueError(f"step graph sizes must be positive, got {sizes}")
        self.model, self.kv_cache, self.lora_pool = model, kv_cache, lora_pool
        self.scopes = scopes
        self.sizes = tuple(sorted(set(sizes)))
        self.device = model.embed.weight.device
        self.buffers = piece_buffers(model, self.sizes[-1])
        self._graphs: dict[tuple[int, LoraScope], _StepGraph] = {}

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size (largest first) and scope into one memory pool."""
        pool = None
        for size in reversed(self.sizes):
            for scope in self.scopes:
                graph = self._capture(size, scope, pool)
                pool = graph.pieces[0].pool()
                self._graphs[size, scope] = graph

    def graph_for(self, batch: BatchMetadata) -> _StepGraph | None:
        """The smallest captured graph of the batch's scope that holds its tokens."""
        if not self._graphs or batch.num_tokens > self.max_tokens:
            return None
        scope = LoraScope.serving(batch.lora, self.scopes)
        size = next(s for s in self.sizes if s >= batch.num_tokens)
        return self._graphs.get((size, scope))

    def run(self, graph: _StepGraph, input_ids: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        """The step's final hidden states [T, hidden]: the pieces replayed, each layer's
        attention run on `batch` between them."""
        graph.step.load(input_ids, batch)
        graph.pieces[0].replay()
        for i, (layer, state) in enumerate(zip(self.model.layers, graph.states, strict=False)):
            layer.attn.attend(state.queries, batch, self.kv_cache.layer(i))
            graph.pieces[i + 1].replay()
        return graph.states[-1].h[: batch.num_tokens]

    def _capture(self, size: int, scope: LoraScope, pool: tuple[int, int] | None) -> _StepGraph:
        step = PaddedStep(size, scope, self.kv_cache, self.lora_pool, self.device)
        inputs, batch = step.inputs, step.batch
        model, kv_cache, buffers = self.model, self.kv_cache, self.buffers
        layers = len(model.layers)
        # Warm up outside the graphs: Triton compiles here. The pieces run back to back, as
        # they are captured: on the static batch (no decode rows, no prefill groups) the
        # attention between them would have nothing to do.
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
        return _StepGraph(step, pieces, states)
