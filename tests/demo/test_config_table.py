"""The README's configuration table is the one the parsers give today."""

from __future__ import annotations

from adapter_store.rpc.settings import env_name
from inference_svc.__main__ import build_parser
from tools.config_table import README, readme_section, render


def test_readme_table_is_up_to_date() -> None:
    assert readme_section(README.read_text()) == render(), (
        "the README's configuration table is stale: run `python -m tools.config_table --write`"
    )


def test_table_lists_every_inference_flag_with_its_env_var(monkeypatch) -> None:
    monkeypatch.setenv("LORASERVE_MAX_LORAS", "3")  # the table ignores this shell's settings
    table = render()
    assert "| `--max-loras` | `LORASERVE_MAX_LORAS` | `8` |" in table
    serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    for action in serve._actions:
        if action.option_strings and action.dest != "help":
            flag = action.option_strings[0]
            assert f"| `{flag}` | `{env_name(flag)}` |" in table
