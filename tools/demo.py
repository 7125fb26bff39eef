"""`make demo` (`python -m tools.demo`): the whole system on this machine, CPU only.

Starts Redis, SeaweedFS, the adapter store and the inference service (detached; state,
pids and logs under `.demo/`), registers the embedded base model, uploads the shipped
adapters, runs the same prompts with the base model and each adapter, prints them side by
side with timings, and leaves the stack running. `make down` (`--down`) stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from adapter_store.cli import ProgressBar
from adapter_store.client import StoreClient
from inference_svc.model.tiny import EMBEDDED_ADAPTERS_DIR, EMBEDDED_BASE_DIR, TINY_MODEL_NAME
from protos import adapter_store_pb2
from tools import demo_stack
from tools.demo_generate import generate_side_by_side
from tools.demo_report import render_prompt
from tools.stack import REPO_ROOT, weed_binary

PROMPTS = (
    "def read_config(path):\n",
    "import os\nimport sys\n\nclass ",
    "The module provides",
    "    for item in items:\n        if ",
)
DEFAULT_STATE_DIR = REPO_ROOT / ".demo"


def say(line: str) -> None:
    print(line, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__)
    parser.add_argument("--down", action="store_true", help="stop the stack, remove its state")
    parser.add_argument(
        "--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts"
    )
    parser.add_argument("--max-new-tokens", type=int, default=40, help="tokens per completion")
    parser.add_argument(
        "--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="pids, ports, data and logs"
    )
    return parser


def shipped_adapters() -> list[Path]:
    return sorted(p for p in EMBEDDED_ADAPTERS_DIR.iterdir() if p.is_dir())


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run the stack, as messages a person can act on."""
    missing = []
    if shutil.which("redis-server") is None:
        missing.append(
            "redis-server is not installed: sudo apt-get install redis-server "
            "(Debian/Ubuntu) or brew install redis (macOS), then run `make demo` again"
        )
    try:
        weed_binary()
    except RuntimeError as error:
        missing.append(f"{error} (`make setup` installs it into .venv)")
    if not (EMBEDDED_BASE_DIR / "model.safetensors").is_file():
        missing.append(f"the embedded model is missing from {EMBEDDED_BASE_DIR}")
    return missing


async def publish_model_and_adapters(address: str) -> list[adapter_store_pb2.Adapter]:
    """Register the base model (idempotent) and upload each shipped adapter the store does
    not hold yet, with a progress bar."""
    adapters = []
    async with StoreClient(address) as store:
        config = (EMBEDDED_BASE_DIR / "config.json").read_text()
        await store.register_base_model(demo_stack.BASE_MODEL, config)
        say(f"registered base model {demo_stack.BASE_MODEL!r} ({EMBEDDED_BASE_DIR.name}/)")
        width = max(len(folder.name) for folder in shipped_adapters())
        for folder in shipped_adapters():
            try:
                adapter = await store.get_adapter(folder.name)
                say(f"{folder.name:<{width}} already in the store (version {adapter.version})")
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                adapter = await store.upload_dir(
                    folder,
                    name=folder.name,
                    base_model=demo_stack.BASE_MODEL,
                    description="shipped with loraserve (docs/demo_model.md)",
                    labels={"source": "demo"},
                    progress=ProgressBar(label=f"{folder.name:<{width}}"),
                )
            adapters.append(adapter)
    return adapters


def _adapter_line(adapter: adapter_store_pb2.Adapter) -> str:
    return (
        f"  {adapter.name}@{adapter.version}: rank {adapter.rank}, "
        f"{adapter.size_bytes / 1e6:.1f} MB, {', '.join(adapter.target_modules)}"
    )


def shown(path: Path) -> str:
    """`path` relative to the working directory when it lies below it."""
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def _loractl() -> str:
    installed = Path(sys.executable).parent / "loractl"
    if installed.exists():
        return shown(installed)
    return f"{shlex.quote(sys.executable)} -m adapter_store.cli"


def _bash_quoted(text: str) -> str:
    """`text` as a bash $'…' word, so a newline stays on one printed line."""
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return f"$'{escaped}'"


def _down_command(state_dir: Path) -> str:
    if state_dir == DEFAULT_STATE_DIR:
        return "make down"
    return f"{shlex.quote(sys.executable)} -m tools.demo --down --state-dir {shown(state_dir)}"


def how_to_use(stack: demo_stack.DemoStack, adapter: str) -> str:
    store, inference = stack.store.address, stack.inference.address
    loractl = f"{_loractl()} --store {store}"
    request = json.dumps(
        {"adapter": adapter, "prompt": PROMPTS[0], "sampling": {"max_new_tokens": 32}}
    )
    state = shown(stack.state_dir)
    return "\n".join(
        [
            f"The stack keeps running (pids, ports and data in {state}/, logs in {state}/logs/):",
            f"  adapter store  {store}      inference  {inference}",
            f"  Redis          {stack.redis.url}   S3  {stack.s3.endpoint_url} "
            f"(bucket {demo_stack.BUCKET})",
            "",
            "Call it with loractl:",
            f"  {loractl} list",
            f"  {loractl} get {adapter}",
            f"  {loractl} generate --inference {inference} --adapter {adapter} "
            f"{_bash_quoted(PROMPTS[0])}",
            f"  {loractl} upload PEFT_FOLDER --name my-adapter --base-model "
            f"{demo_stack.BASE_MODEL}",
            "and with grpcurl (the services serve reflection):",
            f"  grpcurl -plaintext {inference} list",
            f"  grpcurl -plaintext -d '{request}' {inference} loraserve.v1.Inference/Generate",
            "",
            f"Stop it: {_down_command(stack.state_dir)}",
        ]
    )


def run_demo(args: argparse.Namespace) -> int:
    missing = missing_prerequisites()
    if missing:
        for message in missing:
            print(f"make demo: {message}", file=sys.stderr)
        return 1
    say("== loraserve demo: the whole stack on this machine (CPU) ==")
    stack = demo_stack.up(args.state_dir, TINY_MODEL_NAME, say)
    adapters = asyncio.run(publish_model_and_adapters(stack.store.address))
    say("adapters in the store:")
    for adapter in adapters:
        say(_adapter_line(adapter))

    prompts = PROMPTS[: args.prompts]
    refs = ["", *(adapter.name for adapter in adapters)]
    say(
        f"\n== {len(prompts)} prompt(s), greedy, {args.max_new_tokens} new tokens; per prompt "
        f"the base model and {len(adapters)} adapters run together in one batch =="
    )
    results = asyncio.run(
        generate_side_by_side(stack.inference.address, prompts, refs, args.max_new_tokens)
    )
    width = shutil.get_terminal_size((160, 24)).columns
    for prompt, completions in zip(prompts, results, strict=True):
        say("\n" + render_prompt(prompt, completions, width))
    say(
        "\n(TTFT: request sent → first token; the first request of an adapter includes "
        "fetching it from S3 into a LoRA slot)"
    )
    say("\n" + how_to_use(stack, adapters[-1].name if adapters else ""))
    return 0


def run_down(state_dir: Path) -> int:
    if demo_stack.down(state_dir, say):
        say(f"stopped the demo stack and removed {shown(state_dir)}")
    else:
        say("no demo stack is running")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1:
        raise SystemExit("--prompts and --max-new-tokens must be at least 1")
    if args.down:
        return run_down(args.state_dir)
    try:
        return run_demo(args)
    except (RuntimeError, TimeoutError, grpc.RpcError, OSError) as error:
        message = error.details() if isinstance(error, grpc.RpcError) else error
        print(f"make demo failed: {message}", file=sys.stderr)
        print(f"logs: {shown(args.state_dir)}/logs/", file=sys.stderr)
        print(f"clean up with: {_down_command(args.state_dir)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
