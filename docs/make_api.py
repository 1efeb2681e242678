"""Write docs/api.md from the public docstrings: ``python docs/make_api.py`` (``--check`` to compare)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import gradscaler

TARGET = Path(__file__).with_name("api.md")


def render() -> str:
    out = ["# API reference", "", "Generated from the docstrings by `docs/make_api.py`; do not edit by hand.", ""]
    for name in gradscaler.__all__:
        obj = getattr(gradscaler, name)
        signature = ""
        if inspect.isclass(obj) and name == "GradScaler":
            signature = str(inspect.signature(obj))
        out += [f"## `{name}{signature}`", "", inspect.cleandoc(obj.__doc__ or ""), ""]
        if name != "GradScaler":
            continue
        for member_name, member in inspect.getmembers(obj):
            if member_name.startswith("_") or not callable(member):
                continue
            out += [
                f"### `GradScaler.{member_name}{inspect.signature(member)}`",
                "",
                inspect.cleandoc(member.__doc__ or ""),
                "",
            ]
    return "\n".join(out)


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        return 0 if TARGET.read_text() == text else 1
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
