"""JSONL as the workbook writes and reads it: one JSON object per line, UTF-8, non-ASCII characters kept as they are.

Why one home: `json.dumps(..., ensure_ascii=False)` leaves U+2028, U+2029 and U+0085 unescaped inside strings (it
escapes only the controls below U+0020), and `str.splitlines()` splits on all three. A few of the cached
self-instruct replies of the 4x SmolLM2 run (docs/gpu.md#several-generation-engines) held one: read back
with `splitlines()` each became torn lines, was dropped, and was generated again on the rerun; since a conversation's
reply temperature follows its position, the new requests then shifted most of the distillation cache's keys (on the
H200 the rerun started four engines instead of none). Lines are split on "\n" only, which `json.dumps` always
escapes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def dumps(rows: Iterable[Any]) -> str:
    """The JSONL text of `rows`, each line ending in a newline."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def lines(path: Path) -> list[str]:
    """The non-blank lines of a JSONL file, split on "\\n" only (see the module docstring)."""
    return [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def read(path: Path) -> list[Any]:
    """Every record of a JSONL file the workbook wrote (a malformed line raises json.JSONDecodeError)."""
    return [json.loads(line) for line in lines(path)]
