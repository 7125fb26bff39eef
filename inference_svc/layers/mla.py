"""Multi-head latent attention (MLA) over the paged latent cache.

Shape legend: T tokens in the step, D decode tokens (rows [0, D)), H heads, C kv_lora_rank,
R rope dim, n qk_nope_head_dim, v v_head_dim.

Projections are `Linear` calls with the input at hand, named like the canonical LoRA
modules: `qkv_a` (q_a_proj ⊕ kv_a_proj_with_mqa, or kv_a alone when q_lora_rank is null,
with `q` = q_proj), `q_b`, `kv_b`, `o`. Decode keeps `q_nope` (before absorbing W_UK) and
`o_lat` (attention output in latent space, before W_UV) as explicit tensors; prefill expands
K/V from the latent through `kv_b`, so a kv_b LoRA there is an ordinary linear delta.

LoRA (`batch.lora`): qkv_a, q, q_b and o add their deltas inside `Linear`; kv_b's delta is
added to the expanded K/V in prefill and folded into q_lat / the per-head output around the
absorbed decode attention (`inference_svc.lora.apply`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inference_svc.engine.batch import BatchMetadata
from inference_svc.layers.linear import Linear
from inference_svc.layers.norm import RMSNorm
from inference_svc.layers.quant import QuantMethod, UnquantizedMethod
from inference_svc.layers.rope import RotaryEmbedding
from inference_svc.lora import apply as lora_apply
from inference_svc.lora.apply import (
    add_kv_b_absorbed_o,
    one_token_kv_b_lora,
    set_kv_b_absorbed_q,
)
from inference_svc.model.config import ModelConfig
from kernels.gemv import ResidualAdd, gemv_per_head, gemv_per_head_fits
from kernels.latent_cache import write_latent_cache, write_latent_cache_ref
from kernels.lora_segments import LoraSegments
from kernels.mla_attention import decode_merges, mla_decode, mla_decode_ref
from kernels.mla_prefill import mla_prefill_varlen, mla_prefill_varlen_ref

# A one-token decode step absorbs W_UK into q and W_UV out of o_lat with kernels.gemv (two
# ~2 MB per-head products that cuBLAS ran as bmm launches of ~4 µs each, not overlapped
# with their neighbours). H100, 27-layer V2-Lite B=1 step (bench.model_decode, patch
# "absorb_gemv" turns it off): 2.831 → 2.704 ms.
ABSORB_GEMV = True


@dataclass(frozen=True)
class AttentionQueries:
    """A layer's queries between `MLAAttention.project` and `attend`.

    q_nope [T, H, n] and q_rope [T, H, R] (rotated); out [T, H, v], which `attend` writes;
    q_lat_lora [T, H, C]: kv_b's absorbed query correction already set by q_b's expand (a
    step of decode tokens only), else None.
    """

    q_nope: torch.Tensor
    q_rope: torch.Tensor
    out: torch.Tensor
    q_lat_lora: torch.Tensor | None


@dataclass(frozen=True)
class QueryBuffers:
    """Fixed buffers a step graph's pieces leave every layer's queries in (rows past a
    piece's tokens unused): q [T_max, H·(n+R)], q_rope [T_max, H, R], out [T_max, H, v]."""

    q: torch.Tensor
    q_rope: torch.Tensor
    out: torch.Tensor


class MLAAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        quant: QuantMethod,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__()
        c = config
        self.num_heads, self.kv_lora_rank = c.num_heads, c.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        )
        self.q_lora_rank = c.q_lora_rank
        self.scale = c.softmax_scale
        q_width = c.num_heads * c.qk_head_dim
        kv_a_width = c.kv_lora_rank + c.qk_rope_head_dim
        if c.q_lora_rank is None:
            self.qkv_a = Linear(c.hidden_size, [kv_a_width], quant, dtype, device)
            self.q = Linear(c.hidden_size, [q_width], quant, dtype, device)
        else:
            self.qkv_a = Linear(c.hidden_size, [c.q_lora_rank, kv_a_width], quant, dtype, device)
            self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype, device)
            self.q_b = Linear(c.q_lora_rank, [q_width], quant, dtype, device)
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, dtype, device)
        # kv_b stays unquantized: the absorbed decode reads its per-head W_UK / W_UV directly.
        self.kv_b = Linear(
            c.kv_lora_rank, [c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)],
            UnquantizedMethod(), dtype, device,
        )  # fmt: skip
        self.o = Linear(c.num_heads * c.v_head_dim, [c.hidden_size], quant, dtype, device)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b's weight split per head: W_UK [H, n, C] and W_UV [H, v, C]."""
        w = self.kv_b.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def takes_input_norm(self, x: torch.Tensor, batch: BatchMetadata) -> bool:
        """Whether `project` can take the decoder's residual add and input norm for x
        [T, hidden]: every linear that reads the input takes them (Linear.takes_residual)."""
        lora = batch.lora.tokens if batch.lora is not None else None
        readers = (self.qkv_a,) if self.q_lora_rank is not None else (self.qkv_a, self.q)
        return all(linear.takes_residual(x, lora) for linear in readers)

    def project(
        self,
        x: torch.Tensor,
        batch: BatchMetadata,
        rope: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_pool: torch.Tensor,
        input_norm: tuple[RMSNorm, ResidualAdd] | None = None,
        buffers: QueryBuffers | None = None,
    ) -> AttentionQueries:
        """The token-wise half before attention: the query projections and the step's latent
        rows written into `kv_pool` (then `attend`, then `output`). `input_norm` (where
        `takes_input_norm`): x is the residual stream, the attention's input is norm(h) for
        h = x + Σ addends, made by the linears that read it, which store h into the
        ResidualAdd's h. With `buffers` (a step graph's piece) the queries are
        copied into them and `out` is theirs: the attention between two captured pieces
        then reads and writes the same memory at every layer."""
        tokens = x.shape[0]
        lora = batch.lora.tokens if batch.lora is not None else None
        norm, residual = input_norm if input_norm is not None else (None, None)
        qkv_a = self.qkv_a(x, lora, norm=norm, residual=residual)
        q_lat_lora = None
        if self.q_lora_rank is None:
            q = self.q(x, lora, norm=norm, residual=residual)
            kv_a = qkv_a
        else:
            q_a, kv_a = qkv_a.split([self.q_lora_rank, qkv_a.shape[-1] - self.q_lora_rank], -1)
            q, q_lat_lora = self._q_b(q_a, lora, batch)
        if buffers is not None:
            q = buffers.q[:tokens].copy_(q)
        q = q.view(tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)  # [T, H, n], [T, H, R]
        cos, sin = cos_sin
        # kv_a_norm of the latent, RoPE of k_rope and of q_rope, the scatter into the cache:
        # one launch.
        write = write_latent_cache if x.is_cuda else write_latent_cache_ref
        q_rope = write(
            kv_a, self.kv_a_norm.weight, self.kv_a_norm.eps, cos, sin, rope.interleave,
            kv_pool.view(-1, kv_pool.shape[-1]), batch.slot_mapping, q_rope,
        )  # [T, H, R]  # fmt: skip
        if buffers is None:
            out = x.new_empty((tokens, self.num_heads, self.v_dim))  # [T, H, v]
        else:
            q_rope = buffers.q_rope[:tokens].copy_(q_rope)
            out = buffers.out[:tokens]
        return AttentionQueries(q_nope, q_rope, out, q_lat_lora)

    def attend(
        self, queries: AttentionQueries, batch: BatchMetadata, kv_pool: torch.Tensor
    ) -> None:
        """Attention of the step's tokens (rows [0, batch.num_tokens) of `queries`: a step
        graph's are padded) into `queries.out`: the absorbed paged path for the decode rows,
        the expanded causal path for the prefill rows."""
        q_nope, q_rope, out = queries.q_nope, queries.q_rope, queries.out
        decodes = batch.num_decode_tokens
        if decodes:
            self._decode(
                q_nope[:decodes], q_rope[:decodes], batch, kv_pool, out[:decodes],
                queries.q_lat_lora,
            )  # fmt: skip
        if decodes < batch.num_tokens:
            self._prefill(q_nope, q_rope, batch, kv_pool, out)

    def output(self, out: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        """The o projection (with its LoRA) of the attention's out [T, H, v] → [T, hidden]."""
        lora = batch.lora.tokens if batch.lora is not None else None
        return self.o(out.view(out.shape[0], self.num_heads * self.v_dim), lora)

    def _q_b(
        self, q_a: torch.Tensor, lora: LoraSegments | None, batch: BatchMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q_b's product of q_a [T, q_lora_rank] with its LoRA → (q [T, H·(n+R)], q_lat).
        In a step of decode tokens only, whose q_b does not run the one-token LoRA kernel,
        q_b's expand also sets kv_b's absorbed query correction (one launch,
        lora_apply.finish_q_b_lora_with_kv_b_q): q_lat [T, H, C] holds it. Else q_lat is
        None and the decode path applies kv_b's LoRA itself."""
        q_b, kv_b = self.q_b.lora, self.kv_b.lora
        fuse = (
            lora is not None
            and q_b is not None
            and kv_b is not None
            and batch.num_decode_tokens == q_a.shape[0]
            and not self.q_b.runs_one_token_lora(q_a)
            and lora_apply.fuses_q_b_lora_with_kv_b_q(q_b, kv_b)
        )
        if not fuse:
            return self.q_b(q_a, lora, norm=self.q_a_norm), None
        q, pending = self.q_b.forward_leaving_expand(q_a, lora, norm=self.q_a_norm)
        q_lat = q.new_empty((q.shape[0], self.num_heads, self.kv_lora_rank))
        lora_apply.finish_q_b_lora_with_kv_b_q(pending, q, q_b, kv_b, q_lat, self.nope_dim)
        return q, q_lat

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        batch: BatchMetadata,
        kv_pool: torch.Tensor,
        out: torch.Tensor,
        q_lat_lora: torch.Tensor | None = None,
    ) -> None:
        """Absorbed attention of the D decode tokens: [D, H, n], [D, H, R] → out [D, H, v].
        `q_lat_lora` [D, H, C]: kv_b's query correction, already set (`_q_b`).

        The batched matmuls write [D, H, ·] through transposed views and the attention
        kernel takes strided queries, so no copy launches sit between them.
        """
        w_uk, w_uv = self._w_uk_uv()
        q_lat = q_lat_lora
        if q_lat is None:
            q_lat = q_nope.new_empty((q_nope.shape[0], self.num_heads, self.kv_lora_rank))
        lora = batch.lora.decode_tokens if batch.lora is not None else None
        kv_b_lora = self.kv_b.lora if lora is not None else None
        # One token: both absorptions are per-head GEMVs whose weight reads overlap the
        # previous kernel (kernels.gemv), kv_b's LoRA corrections in their epilogues;
        # cuBLAS's bmm waits for it to finish.
        one_token = ABSORB_GEMV and q_nope.is_cuda and q_nope.shape[0] == 1
        q_gemv = (
            one_token
            and q_lat_lora is None
            and gemv_per_head_fits(q_nope[0], w_uk.transpose(1, 2), q_lat[0])
        )
        o_gemv = one_token and gemv_per_head_fits(q_lat[0], w_uv, out[0])  # o_lat: q_lat's shape
        q_lora = o_lora = None
        if kv_b_lora is not None and (q_gemv or o_gemv) and lora_apply.ONE_TOKEN_LORA_IN_GEMV:
            # Each side separately: a side whose product is not a GEMV keeps its launch.
            q_lora, o_lora = one_token_kv_b_lora(kv_b_lora, lora, self.num_heads, self.nope_dim)
            q_lora, o_lora = (q_lora if q_gemv else None), (o_lora if o_gemv else None)
        if kv_b_lora is not None and q_lora is None:
            # kv_b's LoRA correction first, the absorbed product added onto it: the
            # correction's launch then follows a Triton kernel (the latent-cache write),
            # whose run its weight reads overlap (PDL; kernels.mla_lora "prefetch"),
            # unless q_b's expand has set it already (`_q_b`).
            if q_lat_lora is None:
                set_kv_b_absorbed_q(q_nope, q_lat, kv_b_lora, lora)
            q_lat.transpose(0, 1).baddbmm_(q_nope.transpose(0, 1), w_uk)  # [D, H, C]
        elif q_gemv:
            gemv_per_head(q_nope[0], w_uk.transpose(1, 2), q_lat[0], q_lora)  # [H, C]
        else:
            torch.bmm(q_nope.transpose(0, 1), w_uk, out=q_lat.transpose(0, 1))  # [D, H, C]
        n = batch.num_decode_seqs
        attention = (q_lat, q_rope, kv_pool, batch.page_table[:n], batch.context_lens[:n])
        # kv_b's output correction: written by the attention's split merge where there is
        # one, W_UV's product added onto it; otherwise its own launch after the product
        # (before the product, its weight reads found no room beside the attention:
        # docs/benchmarks.md).
        o_in_merge = (
            kv_b_lora is not None
            and o_lora is None
            and q_nope.is_cuda
            and lora_apply.KV_B_O_IN_MERGE
            and decode_merges(*q_lat.shape)
        )
        if o_in_merge:
            correction = lora_apply.kv_b_absorbed_o_in_merge(out, kv_b_lora, lora)
            o_lat = mla_decode(*attention, self.scale, correction=correction)  # [D, H, C]
            out.transpose(0, 1).baddbmm_(o_lat.transpose(0, 1), w_uv.transpose(1, 2))
            return
        attend = mla_decode if q_nope.is_cuda else mla_decode_ref
        o_lat = attend(*attention, self.scale)  # [D, H, C]
        if o_gemv:
            gemv_per_head(o_lat[0], w_uv, out[0], o_lora)  # [H, v]
        else:
            torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
        if kv_b_lora is not None and o_lora is None:
            add_kv_b_absorbed_o(o_lat, out, kv_b_lora, lora)

    def _prefill(self, q_nope, q_rope, batch: BatchMetadata, kv_pool, out: torch.Tensor) -> None:
        """Causal attention of the prefill sequences against their whole cached context;
        K/V (kv_b with its LoRA delta) expanded for a group of sequences at a time, and
        the group's attention one kernel launch."""
        attend = mla_prefill_varlen if q_nope.is_cuda else mla_prefill_varlen_ref
        flat_pool = kv_pool.view(-1, kv_pool.shape[-1])
        for group, (b0, b1) in enumerate(batch.prefill_groups):
            r0, r1 = batch.context_start_host[b0], batch.context_start_host[b1]
            rows = flat_pool[batch.context_rows[r0:r1]]  # [Σctx, C+R]
            latent, k_rope = rows.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            lora = batch.lora.context_rows[group] if batch.lora is not None else None
            kv = self.kv_b(latent.to(q_nope.dtype), lora)  # [Σctx, H·(n+v)]
            kv = kv.view(kv.shape[0], self.num_heads, -1)
            k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [Σctx, H, n], [.., v]
            attend(
                q_nope, q_rope, k_nope, k_rope, v, out,
                batch.query_start_loc, batch.context_start_loc, batch.context_lens, b0, b1,
                self.scale, max_query_len=max(batch.query_lens[b0:b1]),
            )  # fmt: skip
