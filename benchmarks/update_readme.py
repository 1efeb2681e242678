"""Put a recorded ``gradscaler bench`` text output into docs/benchmarks.md between the bench-gpu markers.

python benchmarks/update_readme.py benchmarks/results/h100-2026-11-22.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
START, END = "<!-- bench-gpu -->\n", "<!-- /bench-gpu -->"


def main(path: str) -> None:
    text = Path(path).read_text()
    tables = text[text.index("One read pass") :].split("numbers written")[0].strip()
    page = PAGE.read_text()
    head, rest = page.split(START, 1)
    PAGE.write_text(head + START + tables + "\n" + END + rest.split(END, 1)[1])


if __name__ == "__main__":
    main(sys.argv[1])
