"""Train the embedded demo model and its LoRA adapters (run on the GPU machine).

Base: a small DeepSeek-V3-architecture model (MLA with q_lora_rank, MoE with a shared and
8 routed experts, noaux_tc routing with the aux-loss-free bias update) trained with
`transformers` on the Python standard library's own source (PSF licence, shipped with every
interpreter, so the data is available offline). Tokenizer: a byte-level BPE trained with
`tokenizers` on the same text.

Adapters (PEFT LoRA on every MLA projection and on the routed experts' fused parameters),
each on a distinct style:
- `docs-prose`: the English reference documentation in `pydoc_data/topics.py`;
- `unittest-style`: the standard library's own test suite (`test/test_*.py`);
- `shouty`: the base corpus upper-cased.

    python3 -m tools.train_demo_model --out OUTDIR [--base-steps N --adapter-steps N]

writes OUTDIR/base (config.json, model.safetensors, tokenizer.json), OUTDIR/adapters/<name>
(adapter_config.json, adapter_model.safetensors), OUTDIR/training.json (losses, settings,
timings) and OUTDIR/loss_curves.png.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
BASE_BYTES = 12_000_000
ADAPTER_BYTES = 3_000_000

MODEL_CONFIG = {
    "hidden_size": 192,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "kv_lora_rank": 64,
    "q_lora_rank": 96,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "max_position_embeddings": 1024,
    "rope_interleave": True,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}

LORA_TARGET_MODULES = ["q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj"]
LORA_TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_corpus(paths: list[Path], limit_bytes: int, transform=lambda s: s) -> str:
    parts, total = [], 0
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = transform(text)
        parts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return "\n<|eos|>\n".join(parts)


def corpora(seed: int) -> dict[str, str]:
    root = stdlib_dir()
    rng = random.Random(seed)
    sources = sorted(
        p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts
    )
    tests = sorted((root / "test").glob("test_*.py"))
    rng.shuffle(sources)
    rng.shuffle(tests)
    topics_path = root / "pydoc_data" / "topics.py"
    namespace: dict = {}
    exec(compile(topics_path.read_text(encoding="utf-8"), str(topics_path), "exec"), namespace)  # noqa: S102 - stdlib data file
    prose = "\n<|eos|>\n".join(namespace["topics"].values())[:ADAPTER_BYTES]
    base = read_corpus(sources, BASE_BYTES)
    return {
        "base": base,
        "docs-prose": prose,
        "unittest-style": read_corpus(tests, ADAPTER_BYTES),
        "shouty": base[:ADAPTER_BYTES].upper(),
    }


def train_tokenizer(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(
        [text[i : i + 100_000] for i in range(0, len(text), 100_000)], trainer
    )
    return tokenizer


def encode(tokenizer, text: str) -> torch.Tensor:
    chunks = [text[i : i + 200_000] for i in range(0, len(text), 200_000)]
    ids = [i for enc in tokenizer.encode_batch(chunks) for i in enc.ids]
    return torch.tensor(ids, dtype=torch.long)


def batches(tokens: torch.Tensor, batch: int, seq: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=generator)
        yield torch.stack([tokens[s : s + seq] for s in starts.tolist()])


class RouterBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: nudge each expert's correction bias
    towards equal load after every step (gamma = update speed)."""

    def __init__(self, model, gamma: float = 1e-3):
        self.gamma = gamma
        self.loads: dict = {}
        self.gates = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        for gate in self.gates:
            gate.register_forward_hook(self._record)

    def _record(self, module, inputs, outputs) -> None:
        topk_indices = outputs[2]
        counts = torch.bincount(topk_indices.flatten(), minlength=module.num_experts).float()
        self.loads[module] = self.loads.get(module, 0) + counts

    @torch.no_grad()
    def update(self) -> float:
        imbalance = 0.0
        for gate, load in self.loads.items():
            gate.e_score_correction_bias += self.gamma * torch.sign(load.mean() - load)
            imbalance = max(imbalance, float(load.max() / load.mean().clamp(min=1)))
        self.loads.clear()
        return imbalance


def train(
    model,
    tokens,
    *,
    steps,
    lr,
    batch,
    seq,
    device,
    log_every,
    label,
    balancer=None,
    max_seconds=None,
):
    """AdamW with warmup + cosine. With `max_seconds`, the step count is cut after 10 timed
    steps so the run (and its cosine schedule) ends inside the budget."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    total = [steps]

    def lr_factor(s: int) -> float:
        warmup = max(1, total[0] // 20)
        return (
            min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total[0]) / total[0]))
        )

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    generator = torch.Generator().manual_seed(1234)
    losses = []
    model.train()
    started = time.time()
    for step, x in enumerate(batches(tokens, batch, seq, generator)):
        if step >= total[0]:
            break
        if max_seconds is not None and step == 10:
            per_step = (time.time() - started) / 10
            total[0] = max(20, min(total[0], int(max_seconds / per_step)))
            print(f"[{label}] {per_step * 1e3:.0f} ms/step -> {total[0]} steps", flush=True)
        x = x.to(device)
        with torch.autocast(
            device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"
        ):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        imbalance = balancer.update() if balancer is not None else None
        if step % log_every == 0 or step == total[0] - 1:
            losses.append({"step": step, "loss": float(loss), "max_load_ratio": imbalance})
            print(
                f"[{label}] step {step}/{total[0]} loss {float(loss):.3f} "
                f"({time.time() - started:.0f}s)",
                flush=True,
            )
    model.eval()
    return losses, time.time() - started


@torch.no_grad()
def sample(model, tokenizer, prompt: str, device, new_tokens: int = 60) -> str:
    ids = torch.tensor([tokenizer.encode(prompt).ids], device=device)
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :].tolist())


def main(argv: list[str] | None = None) -> int:
    from peft import LoraConfig, get_peft_model
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--base-steps", type=int, default=3000)
    parser.add_argument("--adapter-steps", type=int, default=400)
    parser.add_argument("--base-seconds", type=float, default=None, help="time budget")
    parser.add_argument("--adapter-seconds", type=float, default=None, help="time budget each")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    texts = corpora(args.seed)
    tokenizer = train_tokenizer(texts["base"], args.vocab_size)
    token_sets = {name: encode(tokenizer, text) for name, text in texts.items()}
    print({name: len(t) for name, t in token_sets.items()}, flush=True)

    special = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config = DeepseekV3Config(
        vocab_size=tokenizer.get_vocab_size(),
        bos_token_id=special["<|bos|>"],
        eos_token_id=special["<|eos|>"],
        pad_token_id=special["<|pad|>"],
        **MODEL_CONFIG,
    )
    model = DeepseekV3ForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.2f} M", flush=True)
    balancer = RouterBalancer(model)
    report = {
        "config": MODEL_CONFIG,
        "parameters": n_params,
        "args": vars(args) | {"out": str(args.out)},
        "python": sys.version,
        "torch": torch.__version__,
        "tokens": {k: len(v) for k, v in token_sets.items()},
    }
    report["base"], report["base_seconds"] = train(
        model,
        token_sets["base"],
        steps=args.base_steps,
        lr=3e-3,
        batch=args.batch,
        seq=args.seq,
        device=device,
        log_every=25,
        label="base",
        balancer=balancer,
        max_seconds=args.base_seconds,
    )

    base_dir = args.out / "base"
    model.to(torch.bfloat16).save_pretrained(base_dir, safe_serialization=True)
    model.float()
    tokenizer.save(str(base_dir / "tokenizer.json"))
    (base_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "pad_token": "<|pad|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
    )

    prompts = ["def read_config(path):\n", "The list type", "class Stack:\n"]
    samples = {"base": {p: sample(model, tokenizer, p, device) for p in prompts}}
    for name in ("docs-prose", "unittest-style", "shouty"):
        lora = LoraConfig(
            r=args.lora_rank,
            lora_alpha=2 * args.lora_rank,
            target_modules=LORA_TARGET_MODULES,
            target_parameters=LORA_TARGET_PARAMETERS,
            lora_dropout=0.0,
        )
        peft_model = get_peft_model(model, lora)
        report[name], report[f"{name}_seconds"] = train(
            peft_model,
            token_sets[name],
            steps=args.adapter_steps,
            lr=2e-3,
            batch=args.batch,
            seq=args.seq,
            device=device,
            log_every=10,
            label=name,
            max_seconds=args.adapter_seconds,
        )
        samples[name] = {p: sample(peft_model, tokenizer, p, device) for p in prompts}
        peft_model.save_pretrained(args.out / "adapters" / name)
        model = peft_model.unload()
    report["samples"] = samples
    (args.out / "training.json").write_text(json.dumps(report, indent=2))
    plot_losses(report, args.out / "loss_curves.png")
    for name, by_prompt in samples.items():
        print(f"== {name}")
        for prompt, text in by_prompt.items():
            print(repr(prompt), "->", repr(text[:120]))
    return 0


def plot_losses(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    base = report["base"]
    axes[0].plot([p["step"] for p in base], [p["loss"] for p in base])
    axes[0].set(title="base model (stdlib source)", xlabel="step", ylabel="loss")
    for name in ("docs-prose", "unittest-style", "shouty"):
        axes[1].plot(
            [p["step"] for p in report[name]], [p["loss"] for p in report[name]], label=name
        )
    axes[1].set(title="LoRA adapters (rank 8)", xlabel="step", ylabel="loss")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
