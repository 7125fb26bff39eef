"""compose.yaml agrees with the fixed command lines (no Docker engine here: parse and check)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from adapter_store.__main__ import build_parser as store_parser
from adapter_store.rpc.settings import env_name
from inference_svc.__main__ import build_parser as inference_parser

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())


def _known_env(parser, command: str) -> set[str]:
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {
        env_name(opt)
        for action in sub._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    }


def test_services_present_with_healthchecks(compose: dict) -> None:
    services = compose["services"]
    for name in ("redis", "s3", "adapter-store", "inference"):
        assert name in services, f"compose.yaml lacks service {name}"
        assert "healthcheck" in services[name], f"{name} has no healthcheck"
    assert "--appendonly" in services["redis"]["command"]
    gpu = services["inference"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    assert services["inference"]["depends_on"]["adapter-store"]["condition"] == "service_healthy"


@pytest.mark.parametrize(
    ("service", "module", "parser"),
    [
        ("adapter-store", "adapter_store", store_parser),
        ("inference", "inference_svc", inference_parser),
    ],
)
def test_commands_parse_with_the_real_cli(compose, service, module, parser) -> None:
    spec = compose["services"][service]
    command = spec["command"]
    assert command[:4] == ["python", "-m", module, "serve"]
    args = parser().parse_args(command[3:])
    published = {int(p.split(":")[1]) for p in spec["ports"]}
    assert args.port in published, f"{service} listens on {args.port}, not published"
    unknown = {k for k in spec.get("environment", {}) if k.startswith("LORASERVE_")}
    unknown -= _known_env(parser(), "serve")
    assert not unknown, f"{service} sets env vars no flag reads: {sorted(unknown)}"


def test_store_points_at_the_compose_redis_and_s3(compose) -> None:
    args = store_parser().parse_args(compose["services"]["adapter-store"]["command"][3:])
    assert args.redis_url.startswith("redis://redis:")
    s3_port = compose["services"]["s3"]["ports"][0].split(":")[1]
    assert args.s3_endpoint_url == f"http://s3:{s3_port}"
