"""Runs one step of the model: flattened batch in, logits of the requested rows out.

Owns the latent KV cache tensors (the scheduler owns the page allocator) and, on CUDA,
CUDA graphs of the decode step for a set of batch sizes: a decode-only batch of B ≤ the
largest captured size is padded to the next captured size and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference_svc.engine.batch import BatchMetadata
from inference_svc.engine.kv_pages import KVCache, KVCacheConfig
from inference_svc.models.deepseek_v3 import DeepseekV3Model


@dataclass(frozen=True)
class RunnerConfig:
    num_pages: int
    page_size: int = 16
    max_pages_per_seq: int = 256  # page-table width of captured graphs
    cuda_graph_batch_sizes: tuple[int, ...] = field(default=(1, 2, 4, 8, 16, 32, 64, 128, 256))

    def __post_init__(self) -> None:
        if self.num_pages <= 0 or self.page_size <= 0 or self.max_pages_per_seq <= 0:
            raise ValueError("num_pages, page_size and max_pages_per_seq must be > 0")
        if any(b <= 0 for b in self.cuda_graph_batch_sizes):
            raise ValueError("cuda_graph_batch_sizes must be positive")


@dataclass
class _DecodeGraph:
    """A captured decode step of `size` sequences and its static inputs/outputs."""

    size: int
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    batch: BatchMetadata
    logits: torch.Tensor


class ModelRunner:
    def __init__(self, model: DeepseekV3Model, config: RunnerConfig):
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
        self._graphs: dict[int, _DecodeGraph] = {}

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        """input_ids [T] of `batch` → float32 logits [len(batch.logits_indices), vocab]."""
        graph = self._graph_for(batch)
        if graph is not None:
            return self._replay(graph, input_ids, batch)
        hidden = self.model(input_ids, batch, self.kv_cache)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def _graph_for(self, batch: BatchMetadata) -> _DecodeGraph | None:
        decode_only = batch.num_decode_seqs == batch.num_seqs
        if not self._graphs or not decode_only:
            return None
        if batch.page_table.shape[1] > self.config.max_pages_per_seq:
            return None
        fitting = [size for size in self._graphs if size >= batch.num_seqs]
        return self._graphs[min(fitting)] if fitting else None

    def _static_decode_batch(self, size: int) -> tuple[torch.Tensor, BatchMetadata]:
        """Inputs of a padding-only decode batch: every row reads/writes the scratch page."""
        page_size = self.config.page_size
        scratch = self.kv_cache.scratch_page
        device = self.device
        batch = BatchMetadata(
            positions=torch.zeros(size, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            context_lens=torch.ones(size, dtype=torch.int32, device=device),
            page_table=torch.full(
                (size, self.config.max_pages_per_seq), scratch, dtype=torch.int32, device=device
            ),
            slot_mapping=torch.full((size,), scratch * page_size, dtype=torch.int64, device=device),
            logits_indices=torch.arange(size, dtype=torch.int64, device=device),
            num_decode_seqs=size,
            query_lens=(1,) * size,
            context_lens_host=(1,) * size,
            page_size=page_size,
        )
        return torch.zeros(size, dtype=torch.int64, device=device), batch

    @torch.inference_mode()
    def capture_decode_graphs(self) -> None:
        """Capture the decode step for each configured batch size (CUDA only)."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a CUDA device")
        pool = None
        for size in sorted(self.config.cuda_graph_batch_sizes, reverse=True):
            input_ids, batch = self._static_decode_batch(size)
            # Warm up outside the graph: Triton compiles and autotunes here.
            self.model.compute_logits(self.model(input_ids, batch, self.kv_cache))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.compute_logits(self.model(input_ids, batch, self.kv_cache))
            pool = graph.pool()
            self._graphs[size] = _DecodeGraph(size, graph, input_ids, batch, logits)

    def release_decode_graphs(self) -> None:
        """Drop the captured graphs (and their memory pool) so they can be captured anew."""
        self._graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _replay(self, g: _DecodeGraph, input_ids: torch.Tensor, batch: BatchMetadata):
        n, static = batch.num_seqs, g.batch
        scratch = self.kv_cache.scratch_page
        g.input_ids.zero_()
        g.input_ids[:n].copy_(input_ids)
        static.positions.zero_()
        static.positions[:n].copy_(batch.positions)
        static.slot_mapping.fill_(scratch * self.config.page_size)
        static.slot_mapping[:n].copy_(batch.slot_mapping)
        static.context_lens.fill_(1)
        static.context_lens[:n].copy_(batch.context_lens)
        static.page_table.fill_(scratch)
        static.page_table[:n, : batch.page_table.shape[1]].copy_(batch.page_table)
        g.graph.replay()
        return g.logits[:n][batch.logits_indices]
