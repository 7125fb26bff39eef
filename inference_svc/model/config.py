"""Model configuration: one validated dataclass parsed from a Hugging Face `config.json`.

Accepts DeepSeek-V3 (`deepseek_v3`, also Kimi-K2's `kimi_k2`), DeepSeek-V2 (`deepseek_v2`)
and multimodal wrappers that carry one of them as `text_config`. Anything the runtime does
not implement is rejected here, at start-up, instead of producing wrong output later.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v2")
SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")
SCORING_FUNCS = ("sigmoid", "softmax")


class UnsupportedConfigError(ValueError):
    """The checkpoint's config asks for something this runtime does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of the `qk_rope_head_dim` part of each query/key head."""

    dim: int
    theta: float = 10000.0
    interleave: bool = True
    # YaRN (rope_type "yarn"); `factor == 1` means plain RoPE.
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % 2:
            raise UnsupportedConfigError(f"qk_rope_head_dim must be even and > 0, got {self.dim}")
        if self.factor < 1.0:
            raise UnsupportedConfigError(f"rope factor must be >= 1, got {self.factor}")

    @property
    def is_yarn(self) -> bool:
        return self.factor > 1.0


@dataclass(frozen=True)
class RoutingConfig:
    """How a MoE layer picks its experts for a token."""

    num_experts: int
    top_k: int
    scoring: str = "sigmoid"
    method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in TOPK_METHODS:
            raise UnsupportedConfigError(
                f"topk_method {self.method!r} is not one of {TOPK_METHODS}"
            )
        if self.scoring not in SCORING_FUNCS:
            raise UnsupportedConfigError(f"scoring_func {self.scoring!r} not in {SCORING_FUNCS}")
        if self.method == "noaux_tc" and self.scoring != "sigmoid":
            raise UnsupportedConfigError("topk_method noaux_tc needs scoring_func sigmoid")
        if self.num_experts % self.n_group:
            raise UnsupportedConfigError(
                f"n_routed_experts {self.num_experts} not divisible by n_group {self.n_group}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise UnsupportedConfigError(f"topk_group {self.topk_group} not in [1, {self.n_group}]")
        experts_in_groups = self.topk_group * (self.num_experts // self.n_group)
        if not 1 <= self.top_k <= experts_in_groups:
            raise UnsupportedConfigError(
                f"num_experts_per_tok {self.top_k} must be in [1, {experts_in_groups}]"
            )


@dataclass(frozen=True)
class QuantConfig:
    """Checkpoint weight quantization (`quantization_config`)."""

    method: str  # "fp8_block"
    block_n: int = 128
    block_k: int = 128

    def __post_init__(self) -> None:
        if self.method != "fp8_block":
            raise UnsupportedConfigError(f"checkpoint quantization {self.method!r} not supported")
        if self.block_n <= 0 or self.block_k <= 0:
            raise UnsupportedConfigError("weight_block_size entries must be > 0")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to know about a DeepSeek-V2/V3-family checkpoint."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    rope: RopeConfig
    routing: RoutingConfig | None  # None: every layer is dense
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quant: QuantConfig | None = None
    model_type: str = "deepseek_v3"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_lora_rank"):
            if getattr(self, name) <= 0:
                raise UnsupportedConfigError(f"{name} must be > 0")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise UnsupportedConfigError("q_lora_rank must be > 0 or null")
        if self.routing is not None and self.moe_intermediate_size <= 0:
            raise UnsupportedConfigError("moe_intermediate_size must be > 0 for a MoE model")
        if self.moe_layer_freq <= 0:
            raise UnsupportedConfigError("moe_layer_freq must be > 0")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one cached token: compressed latent ⊕ rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale² correction when YaRN is on."""
        scale = self.qk_head_dim**-0.5
        if self.rope.is_yarn and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.routing is not None
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1·mscale·ln(scale) + 1 (1 for scale ≤ 1)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


_IGNORED_DEFAULTS = {
    # key: the only value we implement (anything else is an error)
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "pretraining_tp": 1,
}


def _require_implemented(cfg: dict[str, Any]) -> None:
    for key, supported in _IGNORED_DEFAULTS.items():
        if key in cfg and cfg[key] is not None and cfg[key] != supported:
            raise UnsupportedConfigError(f"config {key}={cfg[key]!r} is not supported")
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise UnsupportedConfigError(
            f"num_key_value_heads={kv_heads} differs from num_attention_heads={heads}; MLA "
            "shares one latent across all heads"
        )


def _parse_rope(cfg: dict[str, Any], rope_dim: int, default_interleave: bool) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; original checkpoints write `rope_scaling` and
    # a top-level `rope_theta`.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    interleave = bool(cfg.get("rope_interleave", default_interleave))
    if rope_type == "default":
        return RopeConfig(dim=rope_dim, theta=theta, interleave=interleave)
    if rope_type != "yarn":
        raise UnsupportedConfigError(f"rope type {rope_type!r} not supported (default, yarn)")
    if params.get("attention_factor") is not None:
        raise UnsupportedConfigError("explicit yarn attention_factor is not supported")
    if params.get("truncate", True) is not True:
        raise UnsupportedConfigError("yarn truncate=false is not supported")
    original = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    factor = params.get("factor")
    if factor is None:
        factor = cfg["max_position_embeddings"] / original
    return RopeConfig(
        dim=rope_dim,
        theta=theta,
        interleave=interleave,
        factor=float(factor),
        original_max_position=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    )


def _parse_routing(cfg: dict[str, Any], is_v3: bool) -> RoutingConfig | None:
    num_experts = cfg.get("n_routed_experts")
    if not num_experts:
        return None
    n_group = cfg.get("n_group") or 1
    return RoutingConfig(
        num_experts=int(num_experts),
        top_k=int(cfg["num_experts_per_tok"]),
        scoring=cfg.get("scoring_func", "sigmoid" if is_v3 else "softmax"),
        method=cfg.get("topk_method", "noaux_tc" if is_v3 else "greedy"),
        n_group=int(n_group),
        topk_group=int(cfg.get("topk_group") or n_group),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", is_v3)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
    )


def _parse_quant(cfg: dict[str, Any]) -> QuantConfig | None:
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise UnsupportedConfigError(f"quantization_config.quant_method {method!r} not supported")
    if q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedConfigError("only e4m3 fp8 with dynamic activation scaling is supported")
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise UnsupportedConfigError("fp8 quantization needs weight_block_size [n, k]")
    return QuantConfig(method="fp8_block", block_n=int(block[0]), block_k=int(block[1]))


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config; multimodal wrappers nest it in `text_config`."""
    text = raw.get("text_config")
    if text is None:
        return raw
    # Quantization is described once for the whole checkpoint, at the top.
    return {"quantization_config": raw.get("quantization_config"), **text}


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Validate an HF config dict and turn it into a `ModelConfig`."""
    cfg = _text_config(raw)
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES and not set(archs) & set(SUPPORTED_ARCHITECTURES):
        raise UnsupportedConfigError(
            f"model_type {model_type!r} / architectures {archs} is not a DeepSeek-V2/V3 model"
        )
    is_v3 = model_type != "deepseek_v2" and "DeepseekV2ForCausalLM" not in archs
    _require_implemented(cfg)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    q_lora_rank = cfg.get("q_lora_rank")
    try:
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
            # V2 checkpoints always interleave; V3 says so with `rope_interleave`.
            rope=_parse_rope(cfg, int(cfg["qk_rope_head_dim"]), default_interleave=True),
            routing=_parse_routing(cfg, is_v3),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quant=_parse_quant(cfg),
            model_type="deepseek_v3" if is_v3 else "deepseek_v2",
        )
    except KeyError as missing:
        raise UnsupportedConfigError(f"config.json lacks required key {missing}") from None


def load_config(folder: Path) -> ModelConfig:
    """Parse `folder/config.json`."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be an HF model folder")
    return parse_config(json.loads(path.read_text()))
