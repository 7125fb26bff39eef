"""DeepSeek-V2/V3 decoder over a flattened batch (prefill and decode tokens together).

Module names follow the canonical LoRA modules: `layers.L.attn.{qkv_a,q,q_b,kv_b,o}`,
`layers.L.mlp.{gate_up,down}` (dense layers and shared experts), `layers.L.moe` (routed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inference_svc.engine.batch import BatchMetadata
from inference_svc.engine.kv_pages import KVCache
from inference_svc.layers.mla import AttentionQueries, MLAAttention, QueryBuffers
from inference_svc.layers.moe import DenseMLP, MoE
from inference_svc.layers.norm import RMSNorm
from inference_svc.layers.quant import QuantMethod
from inference_svc.layers.rope import RotaryEmbedding
from inference_svc.layers.streams import shared_experts_stream
from inference_svc.model.config import ModelConfig
from kernels.gemv import ResidualAdd
from kernels.rms_norm import RoutedPairs

# Outputs not yet added to the residual stream (RMSNorm.add_then_norm).
Addends = tuple[torch.Tensor | RoutedPairs, ...]
# Whether the MoE's router reads a float32 copy of its input made by the norm (bench patch
# "router_input" turns it off: the router converts, one launch per MoE layer).
ROUTER_INPUT_FROM_NORM = True
# Largest step whose shared experts run on their own stream, beside the routed experts. In a
# decode-sized step the routed experts' grouped GEMMs stream the experts' weights for
# hundreds of µs while the shared MLP is a chain of small launches (two matmuls, SiLU·mul,
# with LoRA each module's shrink and expand): side by side, the chain's latency hides
# behind the routed bytes. H100, 8-layer V2-Lite-shaped step, graphs (bench.
# lora_decode_overhead v14, against both on one stream): −39 / −37 / −54 / −27 µs without
# LoRA at B = 1 / 64 / 128 / 256, −105 / −138 / −140 / −141 µs with 32 rank-16 adapters.
# Longer steps are eager (the fork and join cost host time) and unmeasured.
SHARED_EXPERTS_STREAM_MAX_TOKENS = 256
# Smallest step whose router launches (its float32 GEMM, the selection, the alignment) run
# before the fork rather than beside the shared experts. From 2 tokens cuBLAS runs the
# router GEMM as a split-K SIMT kernel, which waited for SMs beside the shared matmuls (6 →
# 26 µs per layer at B = 64); a single token's is a GEMV that runs beside them unharmed.
# H100, 27-layer base step (bench.model_decode v12), route first ÷ fork first: B = 1
# 3.387 / 3.266 ms, 64: 13.69 / 13.68, 128: 15.45 / 15.85, 256: 16.84 / 17.23.
ROUTE_BEFORE_FORK_MIN_TOKENS = 2
# A single token routes first too when its router runs as kernels.gemv (Router.runs_gemv):
# chained to the norm by PDL, the three routing launches then start at once, where beside
# the shared experts' GEMVs (which fill the SMs' registers) they waited for room. H100,
# 27-layer B = 1 step (bench.model_decode, three calls): 2.730 vs 2.822 ms, 2.765 vs
# 2.775 / 2.836, and 2.704 / 2.722 vs 2.766 (bench patch "gemv_route_first" turns it off).
ROUTE_FIRST_WITH_ROUTER_GEMV = True


@dataclass(frozen=True)
class PieceBuffers:
    """Fixed buffers that every piece of a step graph leaves its state in: the residual
    stream h [T_max, hidden] and the queries (`QueryBuffers`)."""

    h: torch.Tensor
    queries: QueryBuffers


def _held(h: torch.Tensor, buffers: PieceBuffers | None) -> torch.Tensor:
    """h [T, hidden] as a piece leaves it: copied into the fixed buffer when the piece is a
    step graph's (`buffers`), else h itself."""
    return h if buffers is None else buffers.h[: h.shape[0]].copy_(h)


@dataclass(frozen=True)
class PieceState:
    """What one piece of a step hands the next across a layer's attention: the residual
    stream h [T, hidden] (all of its addends added), RoPE's tables of the step's positions,
    and the layer's queries, which `attn.attend` completes (None after the last layer,
    where h is the final hidden states)."""

    h: torch.Tensor
    cos_sin: tuple[torch.Tensor, torch.Tensor]
    queries: AttentionQueries | None


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        index: int,
        quant: QuantMethod,
        dtype,
        device,
        expert_quant: QuantMethod | None = None,
    ):
        super().__init__()
        c = config
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.attn = MLAAttention(c, quant, dtype, device)
        self.moe: MoE | None = None
        self.mlp: DenseMLP | None = None
        if c.is_moe_layer(index):
            self.moe = MoE(
                c.hidden_size, c.moe_intermediate_size, c.routing, expert_quant or quant, dtype,
                device,
            )  # fmt: skip
            if c.n_shared_experts:
                shared_inter = c.moe_intermediate_size * c.n_shared_experts
                self.mlp = DenseMLP(c.hidden_size, shared_inter, quant, dtype, device)
        else:
            self.mlp = DenseMLP(c.hidden_size, c.intermediate_size, quant, dtype, device)

    def before_attention(
        self,
        h: torch.Tensor,
        pending: Addends,
        batch: BatchMetadata,
        rope: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_pool: torch.Tensor,
        buffers: QueryBuffers | None = None,
    ) -> tuple[torch.Tensor, AttentionQueries]:
        """The residual add, the input norm and the attention's projections: (h with
        `pending` added, the queries `attn.attend` takes). A layer is this, `attn.attend`,
        then `after_attention`; each residual add rides in the next norm's launch
        (`RMSNorm.add_then_norm`), the FFN's in the next layer's, and so does the routed
        experts' weighted combine."""
        if pending and self.attn.takes_input_norm(h, batch):
            # The add and the norm ride in the attention's first kernel, which stores h.
            residual = ResidualAdd(pending, torch.empty_like(h))
            norm = (self.input_norm, residual)
            queries = self.attn.project(h, batch, rope, cos_sin, kv_pool, norm, buffers)
            return residual.h, queries
        h, x = self.input_norm.add_then_norm(h, pending)
        return h, self.attn.project(x, batch, rope, cos_sin, kv_pool, buffers=buffers)

    def after_attention(
        self, h: torch.Tensor, attn_out: torch.Tensor, batch: BatchMetadata
    ) -> tuple[torch.Tensor, Addends]:
        """The o projection of the attention's out [T, H, v], its residual add, the
        post-attention norm and the FFN: (h, the FFN's outputs not yet added to it)."""
        attn = self.attn.output(attn_out, batch)
        lora = batch.lora.tokens if batch.lora is not None else None
        if self.moe is None:
            h, x = self.post_attn_norm.add_then_norm(h, (attn,))
            return h, (self.mlp(x, lora),)
        # The router's float32 input, written by the norm's launch (no conversion launch).
        x_float = h.new_empty(h.shape, dtype=torch.float32) if ROUTER_INPUT_FROM_NORM else None
        h, x = self.post_attn_norm.add_then_norm(h, (attn,), x_float)
        # No adapter of the step targets the routed experts: their deltas are zero, so the
        # MoE runs its no-LoRA path (LoraBatch.routed_experts).
        moe_lora = lora if batch.lora is not None and batch.lora.routed_experts else None
        if self.mlp is None:
            return h, (self.moe(x, moe_lora, combine=False, x_float=x_float),)
        side = shared_experts_stream(x.device)
        if side is None or x.shape[0] > SHARED_EXPERTS_STREAM_MAX_TOKENS:
            routed = self.moe(x, moe_lora, combine=False, x_float=x_float)
            return h, (routed, self.mlp(x, lora))
        routing = None
        if x.shape[0] >= ROUTE_BEFORE_FORK_MIN_TOKENS or (
            ROUTE_FIRST_WITH_ROUTER_GEMV
            and x_float is not None
            and self.moe.gate.runs_gemv(x_float)
        ):
            routing = self.moe.route(x, x_float, moe_lora)
        # Memory stays ordered without record_stream: x is freed on this stream after the
        # join below, and `shared` (made on the side stream) is read by the next norm on
        # this stream before the side stream next forks from it and could reuse its block.
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            shared = self.mlp(x, lora)
        routed = self.moe(x, moe_lora, combine=False, x_float=x_float, routing=routing)
        main.wait_stream(side)
        return h, (routed, shared)


class DeepseekV3Model(nn.Module):
    """Embedding → decoder layers → final norm; `compute_logits` applies the LM head.

    quant: every weight's format; expert_quant: the routed experts' instead (None: quant).
    """

    def __init__(
        self,
        config: ModelConfig,
        quant: QuantMethod,
        dtype: torch.dtype,
        device,
        expert_quant: QuantMethod | None = None,
    ):
        super().__init__()
        c = config
        self.config = config
        self.dtype = dtype
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.embed.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(c, i, quant, dtype, device, expert_quant) for i in range(c.num_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.lm_head = nn.Linear(
            c.hidden_size, c.vocab_size, bias=False, dtype=dtype, device=device
        )
        self.lm_head.weight.requires_grad_(False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = RotaryEmbedding(c.rope, device)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, batch: BatchMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """input_ids [T] → final hidden states [T, hidden]; writes the step's KV rows.

        The step as its pieces (`first_piece`, `next_piece`) with each layer's attention
        between them: a step graph captures the pieces and runs the attentions eagerly.
        """
        state = self.first_piece(input_ids, batch, kv_cache)
        for i, layer in enumerate(self.layers):
            layer.attn.attend(state.queries, batch, kv_cache.layer(i))
            state = self.next_piece(i, state, batch, kv_cache)
        return state.h

    def first_piece(
        self,
        input_ids: torch.Tensor,
        batch: BatchMetadata,
        kv_cache: KVCache,
        buffers: PieceBuffers | None = None,
    ) -> PieceState:
        """The embedding, RoPE's tables and layer 0 up to its attention."""
        h = self.embed(input_ids)
        cos_sin = self.rope.cos_sin(batch.positions)
        return self._up_to_attention(0, h, (), cos_sin, batch, kv_cache, buffers)

    def next_piece(
        self,
        done: int,
        state: PieceState,
        batch: BatchMetadata,
        kv_cache: KVCache,
        buffers: PieceBuffers | None = None,
    ) -> PieceState:
        """Layer `done` from its attention's out on, then the next layer up to its attention;
        after the last layer the final norm (the state's h is then the hidden states and
        its queries are None)."""
        h, pending = self.layers[done].after_attention(state.h, state.queries.out, batch)
        if done + 1 < len(self.layers):
            return self._up_to_attention(
                done + 1, h, pending, state.cos_sin, batch, kv_cache, buffers
            )
        hidden = self.norm.add_then_norm(h, pending)[1]
        return PieceState(_held(hidden, buffers), state.cos_sin, None)

    def _up_to_attention(
        self,
        index: int,
        h: torch.Tensor,
        pending: Addends,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: BatchMetadata,
        kv_cache: KVCache,
        buffers: PieceBuffers | None,
    ) -> PieceState:
        layer = self.layers[index]
        queries_buffers = buffers.queries if buffers is not None else None
        h, queries = layer.before_attention(
            h, pending, batch, self.rope, cos_sin, kv_cache.layer(index), queries_buffers
        )
        return PieceState(_held(h, buffers), cos_sin, queries)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [L, hidden] → logits [L, vocab] in float32."""
        return self.lm_head(hidden).float()
