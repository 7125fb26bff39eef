"""Command-line flags that also read `LORASERVE_<FLAG>` environment variables.

The environment is read only here, at the service edge; everything below takes config
dataclasses.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

ENV_PREFIX = "LORASERVE_"


def env_name(flag: str) -> str:
    """`--s3-endpoint-url` → `LORASERVE_S3_ENDPOINT_URL`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    type: Any = str,  # noqa: A002 - mirrors argparse
    default: Any = None,
    required: bool = False,
    help: str = "",  # noqa: A002 - mirrors argparse
    choices: list[Any] | None = None,
) -> None:
    """Add `flag`; its default comes from the environment variable when that is set."""
    env = env_name(flag)
    raw = os.environ.get(env)
    if raw is not None:
        default = raw if type is str else (_parse_bool(raw) if type is bool else type(raw))
        required = False
    if type is bool:
        parser.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=bool(default),
            help=f"{help} [env {env}]",
        )
        return
    parser.add_argument(
        flag,
        type=type,
        default=default,
        required=required,
        choices=choices,
        help=f"{help} [env {env}]" + (f" (default: {default})" if default is not None else ""),
    )


def _parse_bool(raw: str) -> bool:
    return raw.strip().lower() in {"1", "true", "yes", "on"}
