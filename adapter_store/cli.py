"""`loractl`: the adapter store for people. Tables by default, `--json` for scripts.

loractl base-model register NAME CONFIG_JSON_OR_HF_FOLDER
loractl upload DIR --name N --base-model B [--label k=v …]
loractl list | get REF | delete REF | fetch REF --out DIR
loractl hash-key KEY        (the sha256 to put in the store's API key file)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from adapter_store.auth import hash_key
from adapter_store.client import StoreClient
from adapter_store.errors import LoraserveError
from adapter_store.rpc.settings import add_flag
from protos import inference_pb2, inference_pb2_grpc

ADAPTER_COLUMNS = ("name", "version", "base_model", "rank", "dtype", "size_bytes", "created_at")
BASE_MODEL_COLUMNS = ("name", "architecture", "lora_modules", "created_at")


def _labels(pairs: Sequence[str]) -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"loractl: --label wants key=value, got {pair!r}")
        labels[key] = value
    return labels


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loractl", description=__doc__.split("\n\n")[0])
    add_flag(parser, "--store", default="127.0.0.1:50051", help="adapter store HOST:PORT")
    add_flag(parser, "--api-key", default=None, help="API key (sent as a bearer token)")
    add_flag(parser, "--tls-ca", default=None, help="PEM CA to trust (TLS); none: plain TCP")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    sub = parser.add_subparsers(dest="command", required=True)

    base = sub.add_parser("base-model", help="register, list or show base models")
    base_sub = base.add_subparsers(dest="base_command", required=True)
    register = base_sub.add_parser("register", help="register a base model by its HF config")
    register.add_argument("name")
    register.add_argument("config", type=Path, help="config.json, or an HF folder holding one")
    base_sub.add_parser("list", help="list base models")
    show = base_sub.add_parser("get", help="show one base model")
    show.add_argument("name")

    upload = sub.add_parser("upload", help="upload a PEFT LoRA folder as a new version")
    upload.add_argument("folder", type=Path)
    upload.add_argument("--name", required=True)
    upload.add_argument("--base-model", required=True)
    upload.add_argument("--description", default="")
    upload.add_argument("--label", action="append", default=[], help="key=value (repeatable)")
    upload.add_argument("--dtype", default="", help="stored dtype (default float32)")

    listing = sub.add_parser("list", help="list adapters (latest versions)")
    listing.add_argument("--base-model", default="")
    listing.add_argument("--label", action="append", default=[], help="key=value (repeatable)")
    listing.add_argument("--all-versions", action="store_true")
    for command, text in (("get", "show an adapter"), ("delete", "delete name@N or all of name")):
        sub.add_parser(command, help=text).add_argument("ref", help="name or name@N")
    fetch = sub.add_parser("fetch", help="download the canonical adapter (sha256 verified)")
    fetch.add_argument("ref")
    fetch.add_argument("--out", type=Path, required=True, help="folder to write into")
    sub.add_parser("hash-key", help="print the at-rest hash of an API key").add_argument("key")
    _add_generate(sub)
    return parser


def _add_generate(sub: argparse._SubParsersAction) -> None:
    generate = sub.add_parser("generate", help="stream a generation from the inference service")
    generate.add_argument("prompt")
    generate.add_argument("--adapter", default="", help="name or name@N (empty: base model)")
    add_flag(generate, "--inference", default="127.0.0.1:50052", help="inference HOST:PORT")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-p", type=float, default=0.0, help="0: off")
    generate.add_argument("--top-k", type=int, default=0, help="0: off")
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


async def _generate(args: argparse.Namespace) -> None:
    """Print text as it streams in; with --json, one JSON object at the end."""
    request = inference_pb2.GenerateRequest(
        adapter=args.adapter,
        prompt=args.prompt,
        sampling=inference_pb2.SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
        ),
    )
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    text, token_ids, finish, version = [], [], 0, 0
    async with grpc.aio.insecure_channel(args.inference) as channel:
        stream = inference_pb2_grpc.InferenceStub(channel).Generate(request, metadata=metadata)
        async for message in stream:
            version = version or message.adapter_version
            text.append(message.text)
            token_ids += message.token_ids
            finish = message.finish_reason
            if not args.json:
                sys.stdout.write(message.text)
                sys.stdout.flush()
    reason = inference_pb2.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower()
    if args.json:
        result = {"text": "".join(text), "token_ids": token_ids, "finish_reason": reason}
        print(json.dumps({**result, "adapter_version": version}))
    else:
        sys.stdout.write("\n")


def _row(message: Any, columns: Sequence[str]) -> list[str]:
    cells = []
    for column in columns:
        value = getattr(message, column)
        cells.append(", ".join(value) if not isinstance(value, str | int) else str(value))
    return cells


def _table(messages: Sequence[Any], columns: Sequence[str]) -> str:
    rows = [list(columns)] + [_row(message, columns) for message in messages]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)


def _print(args: argparse.Namespace, messages: Sequence[Any], columns: Sequence[str]) -> None:
    if args.json:
        print(json.dumps([MessageToDict(m, preserving_proto_field_name=True) for m in messages]))
    else:
        print(_table(messages, columns))


class ProgressBar:
    """A one-line upload progress bar on stderr (`make demo` shows one per adapter)."""

    def __init__(self, label: str = "upload", width: int = 30) -> None:
        self.label = label
        self.width = width

    def __call__(self, sent: int, total: int) -> None:
        done = sent / total if total else 1.0
        bar = "#" * int(done * self.width)
        size = f"{sent / 1e6:.1f}/{total / 1e6:.1f} MB"
        sys.stderr.write(f"\r{self.label} [{bar:<{self.width}}] {done:6.1%} {size}")
        if sent >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _config_text(path: Path) -> str:
    return (path / "config.json" if path.is_dir() else path).read_text()


async def _run(args: argparse.Namespace) -> None:
    async with StoreClient(args.store, api_key=args.api_key, tls_ca=args.tls_ca) as store:
        if args.command == "base-model":
            if args.base_command == "register":
                models = [await store.register_base_model(args.name, _config_text(args.config))]
            elif args.base_command == "get":
                models = [await store.get_base_model(args.name)]
            else:
                models = await store.list_base_models()
            _print(args, models, BASE_MODEL_COLUMNS)
        elif args.command == "upload":
            adapter = await store.upload_dir(
                args.folder,
                name=args.name,
                base_model=args.base_model,
                description=args.description,
                labels=_labels(args.label),
                dtype=args.dtype,
                progress=None if args.json else ProgressBar(),
            )
            _print(args, [adapter], ADAPTER_COLUMNS + ("sha256",))
        elif args.command == "list":
            adapters = await store.list_adapters(
                base_model=args.base_model,
                labels=_labels(args.label),
                all_versions=args.all_versions,
            )
            _print(args, adapters, ADAPTER_COLUMNS)
        elif args.command == "get":
            _print(args, [await store.get_adapter(args.ref)], ADAPTER_COLUMNS + ("sha256",))
        elif args.command == "delete":
            versions = await store.delete_adapter(args.ref)
            print(json.dumps({"deleted": versions}) if args.json else f"deleted {versions}")
        elif args.command == "fetch":
            fetched = await store.fetch_adapter(args.ref)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "weights.safetensors").write_bytes(fetched.weights)
            (args.out / "manifest.json").write_bytes(fetched.manifest_json)
            _print(args, [fetched.adapter], ADAPTER_COLUMNS + ("sha256",))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "hash-key":
        print(hash_key(args.key))
        return 0
    try:
        asyncio.run(_generate(args) if args.command == "generate" else _run(args))
    except grpc.aio.AioRpcError as error:
        print(f"loractl: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except (LoraserveError, OSError) as error:
        print(f"loractl: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
