"""Which of a bf16 runtime's roundings the per-token KL bound can bear: our CPU runner with
some of its bf16 roundings taken away, for `tests.inference.bf16_spread --rounding`.

A bf16 runtime rounds at many points: every linear's input (the tensor cores read bf16),
the latent KV cache (stored bf16, or the cache doubles), the attention's inputs and output,
and, as served, every other intermediate too (GEMM outputs, the residual stream, the MoE
combine). Each mode keeps some of these and computes the rest in float32, on weights that
are bf16 values either way (the embedded model and adapters ship in bf16):

- served: the bf16 runtime as the service runs it;
- fp32-residual: the same, with the residual stream (the embedding output and every add
  into it) kept in float32, the norms writing their bf16 outputs from it;
- bf16-inputs-and-cache: float32 everywhere except what a bf16 tensor-core runtime with a
  bf16 cache must round: the inputs of every linear and of the routed experts, q (whole
  output of q / q_b) and kv_b's output, the cache rows written, the attention's inputs and
  output. It rounds q's rope half and never the LoRA rank intermediate or the routed
  experts' inner activation, so it sits near, not exactly at, that runtime;
- bf16-gemm-inputs: float32 everywhere except the inputs of every linear and of the routed
  experts (a float32 cache and attention).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
from torch import Tensor

import inference_svc.layers.mla as mla
import inference_svc.layers.norm as norm
from inference_svc.layers.linear import Linear
from inference_svc.layers.moe import RoutedExperts
from inference_svc.runtime import Runtime
from kernels.rms_norm import RoutedPairs, add_rms_norm_ref, rms_norm_ref

ROUNDINGS = ("served", "fp32-residual", "bf16-inputs-and-cache", "bf16-gemm-inputs")
# Linears whose outputs only feed the attention (as its inputs, or q_nope's absorption).
ATTENTION_INPUT_LINEARS = ("q", "q_b", "kv_b")


def runtime_dtype(rounding: str) -> str:
    """The dtype the runtime of `rounding` is built in."""
    return "bfloat16" if rounding in ("served", "fp32-residual") else "float32"


@contextmanager
def rounded(runtime: Runtime, rounding: str) -> Iterator[None]:
    """While open, `runtime` (built in `runtime_dtype(rounding)`) rounds as `rounding` says."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding {rounding!r} is not one of {ROUNDINGS}")
    model = runtime.engine.runner.model
    with ExitStack() as stack:
        if rounding == "fp32-residual":
            stack.enter_context(mock.patch.object(norm, "add_rms_norm_ref", _add_norm_fp32))
            stack.enter_context(mock.patch.object(norm.RMSNorm, "forward", _norm_fp32_in))
            handle = model.embed.register_forward_hook(lambda module, args, out: out.float())
            stack.callback(handle.remove)
        if rounding.startswith("bf16-"):
            for name, module in model.named_modules():
                for handle in _linear_hooks(name, module, rounding):
                    stack.callback(handle.remove)
        if rounding == "bf16-inputs-and-cache":
            for attribute, wrap in ATTENTION_WRAPPERS.items():
                original = getattr(mla, attribute)
                stack.enter_context(mock.patch.object(mla, attribute, wrap(original)))
        yield


def _linear_hooks(name: str, module: torch.nn.Module, rounding: str) -> list:
    """Hooks rounding a linear's (or the routed experts') input to bf16, and with a bf16
    cache also the outputs that only feed the attention."""
    if not isinstance(module, Linear | RoutedExperts):
        return []
    hooks = [module.register_forward_pre_hook(_round_args)]
    feeds_attention = name.rsplit(".", 1)[-1] in ATTENTION_INPUT_LINEARS
    if rounding == "bf16-inputs-and-cache" and feeds_attention:
        hooks.append(module.register_forward_hook(lambda module, args, out: bf16(out)))
    return hooks


def bf16(x: Tensor) -> Tensor:
    """x rounded to bf16 and back to its dtype (a float32 tensor holding bf16 values)."""
    return x.to(torch.bfloat16).to(x.dtype)


def _round_args(module: torch.nn.Module, args: tuple) -> tuple:
    return tuple(bf16(a) if isinstance(a, Tensor) and a.is_floating_point() else a for a in args)


def _norm_fp32(h: Tensor, weight: Tensor, eps: float) -> Tensor:
    """rms_norm of a float32 row (the reference's arithmetic), rounded once to the weight's
    dtype."""
    return rms_norm_ref(h.float(), weight, eps).to(weight.dtype)


def _norm_fp32_in(self: norm.RMSNorm, x: Tensor) -> Tensor:
    return _norm_fp32(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


def _add_norm_fp32(
    residual: Tensor, addends: tuple, weight: Tensor, eps: float, y_float: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """add_rms_norm_ref with h (and the addends' sum) in float32, y rounded once to the
    weight's dtype; y_float receives that y, as the served norm gives the router."""
    h, y = add_rms_norm_ref(residual.float(), tuple(map(_as_float32, addends)), weight, eps)
    y = y.to(weight.dtype)
    if y_float is not None:
        y_float.copy_(y.float())
    return h, y


def _as_float32(addend: Tensor | RoutedPairs) -> Tensor | RoutedPairs:
    if isinstance(addend, RoutedPairs):
        return addend._replace(pair_out=addend.pair_out.float())
    return addend.float()


def _cache_rows_rounded(write: Callable) -> Callable:
    def wrapped(kv_a, weight, eps, cos, sin, interleave, rows, slot_mapping, q_rope):
        q_rope = write(kv_a, weight, eps, cos, sin, interleave, rows, slot_mapping, q_rope)
        rows[slot_mapping] = bf16(rows[slot_mapping])
        return bf16(q_rope)

    return wrapped


def _decode_rounded(decode: Callable) -> Callable:
    def wrapped(q_lat, q_rope, *args):
        return bf16(decode(bf16(q_lat), bf16(q_rope), *args))

    return wrapped


def _prefill_rounded(prefill: Callable) -> Callable:
    def wrapped(q_nope, q_rope, k_nope, k_rope, v, out, *args, **kwargs):
        prefill(bf16(q_nope), bf16(q_rope), bf16(k_nope), bf16(k_rope), bf16(v), out, *args,
                **kwargs)  # fmt: skip
        out.copy_(bf16(out))

    return wrapped


# The latent cache write and both attentions, wrapped to round what a bf16 cache and bf16
# attention inputs would.
ATTENTION_WRAPPERS = {
    "write_latent_cache_ref": _cache_rows_rounded,
    "mla_decode_ref": _decode_rounded,
    "mla_prefill_varlen_ref": _prefill_rounded,
}
