"""The parts of a PEFT `adapter_config.json` that change the math, and what we refuse."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# `regex` rather than `re`: client patterns need a timeout (a pattern such as
# `(.*.*.*.*.*)*z` backtracks for minutes under `re`, holding the GIL and freezing the store)
# and `concurrent=True` releases the GIL while matching.
import regex

from adapter_store.errors import InvalidArgument

# Config fields that select a LoRA variant whose forward is not B·A·x (or extra weights the
# canonical format cannot carry). Any truthy value is refused.
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA bias (lora_bias)",
    "modules_to_save": "full copies of modules (modules_to_save)",
    "trainable_token_indices": "trainable/added tokens (trainable_token_indices)",
    "layer_replication": "layer replication (layer_replication)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "velora_config": "VeLoRA (velora_config)",
    "kasa_config": "KaSA (kasa_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
}
# Initialisations that rewrite the base weights: the adapter only works on that rewritten base.
_BASE_ALTERING_INITS = ("pissa", "corda", "olora", "loftq")
# Wall time all of one adapter's rank/alpha pattern matching may take (real patterns: µs).
PATTERN_BUDGET_S = 2.0
MAX_PATTERN_LENGTH = 1024


def _pattern_key(patterns: Mapping[str, Any], peft_key: str, deadline: float) -> str | None:
    """PEFT's `get_pattern_key`: the first pattern that matches a dotted suffix of the key."""
    for pattern in patterns:
        try:
            found = regex.match(
                rf"(.*\.)?({pattern})$",
                peft_key,
                timeout=max(deadline - time.monotonic(), 1e-3),
                concurrent=True,
            )
        except TimeoutError:
            raise InvalidArgument(
                f"adapter_config.json: pattern {pattern[:80]!r} takes too long to match "
                f"{peft_key!r} (catastrophic backtracking?); use plain module names"
            ) from None
        if found:
            return pattern
    return None


@dataclass(frozen=True)
class LoraSettings:
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    # Pattern matching for this adapter must end by then (time.monotonic()).
    match_deadline: float = field(default_factory=lambda: time.monotonic() + PATTERN_BUDGET_S)

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            raise InvalidArgument(
                f"adapter_config.json: r must be a positive integer, got {self.r!r}"
            )
        for name, patterns in (
            ("rank_pattern", self.rank_pattern),
            ("alpha_pattern", self.alpha_pattern),
        ):
            for pattern, value in patterns.items():
                if len(pattern) > MAX_PATTERN_LENGTH:
                    raise InvalidArgument(
                        f"adapter_config.json: {name} key {pattern[:80]!r}… is longer than "
                        f"{MAX_PATTERN_LENGTH} characters"
                    )
                try:
                    regex.compile(pattern)
                except regex.error as exc:
                    raise InvalidArgument(
                        f"adapter_config.json: {name} key {pattern!r} is not a valid regex: {exc}"
                    ) from None
                if (
                    not isinstance(value, int | float)
                    or isinstance(value, bool)
                    or not math.isfinite(value)
                    or value <= 0
                ):
                    raise InvalidArgument(
                        f"adapter_config.json: {name}[{pattern!r}] must be positive, got {value!r}"
                    )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LoraSettings:
        peft_type = config.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise InvalidArgument(
                f"adapter_config.json: peft_type {peft_type!r} is not supported (LORA)"
            )
        for key, what in _UNSUPPORTED_FIELDS.items():
            if config.get(key):
                raise InvalidArgument(f"adapter_config.json: {what} is not supported")
        if config.get("bias", "none") != "none":
            raise InvalidArgument(
                f"adapter_config.json: bias={config['bias']!r} trains base-model biases, "
                "which is not supported (bias must be 'none')"
            )
        init = config.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(_BASE_ALTERING_INITS):
            raise InvalidArgument(
                f"adapter_config.json: init_lora_weights={init!r} rewrites the base weights; "
                "convert the adapter to a plain LoRA before uploading"
            )
        target_modules = config.get("target_modules")
        if target_modules is not None and not isinstance(target_modules, str | list):
            raise InvalidArgument(
                "adapter_config.json: target_modules must be a list, a regex string or 'all-linear'"
            )
        if "r" not in config or "lora_alpha" not in config:
            raise InvalidArgument("adapter_config.json: r and lora_alpha are required")
        alpha = config["lora_alpha"]
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            raise InvalidArgument(
                f"adapter_config.json: lora_alpha must be a number, got {alpha!r}"
            )
        if not math.isfinite(alpha):
            raise InvalidArgument(f"adapter_config.json: lora_alpha must be finite, got {alpha!r}")
        patterns = {}
        for name in ("rank_pattern", "alpha_pattern"):
            value = config.get(name) or {}
            if not isinstance(value, dict):
                raise InvalidArgument(
                    f"adapter_config.json: {name} must be an object of pattern -> number, "
                    f"got {type(value).__name__}"
                )
            patterns[name] = dict(value)
        return cls(
            r=config["r"],
            lora_alpha=alpha,
            use_rslora=bool(config.get("use_rslora", False)),
            **patterns,
        )

    def rank_for(self, peft_key: str) -> int:
        """Rank PEFT gives the module/parameter `peft_key` ("model.layers.0.self_attn.o_proj")."""
        pattern = _pattern_key(self.rank_pattern, peft_key, self.match_deadline)
        return self.r if pattern is None else self.rank_pattern[pattern]

    def scaling_for(self, peft_key: str) -> float:
        """PEFT's scaling: alpha / r (alpha / sqrt(r) with rslora), per-module patterns applied."""
        pattern = _pattern_key(self.alpha_pattern, peft_key, self.match_deadline)
        alpha = self.lora_alpha if pattern is None else self.alpha_pattern[pattern]
        rank = self.rank_for(peft_key)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank
