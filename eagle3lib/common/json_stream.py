"""A JSON array read element by element from a text stream, for files too big to load or cut off mid-record (ShareGPT
V3 as shipped: one 125 MB array that ends inside a record). The C JSON decoder reads each element; a bracket scanner
runs only where an element does not parse, to find where it ends and go on after it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import IO, Any

from eagle3lib.common.errors import WorkbookError

_SEPARATORS = re.compile(r"[\s,]*")
# a JSON string (escapes included), a quote that opens a string the buffer does not close, or a structural character
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|"|[\[\]{},]', re.DOTALL)


def _value_end(buf: str, pos: int) -> int | None:
    """Where the array element starting at `pos` ends (after its closing bracket, or at the ',' or ']' that ends a
    bare value), scanning brackets outside strings; None when it runs past the end of `buf` (read more)."""
    depth = 0
    for m in _TOKENS.finditer(buf, pos):
        tok = m.group()
        if tok == '"':
            return None
        if tok[0] == '"':
            continue
        if tok in "[{":
            depth += 1
        elif tok in "]}":
            if depth == 0:
                return m.start()
            depth -= 1
            if depth == 0:
                return m.end()
        elif depth == 0:  # ','
            return m.start()
    return None


def iter_json_array(f: IO[str], chunk: int = 1 << 20) -> Iterator[tuple[str, Any]]:
    """The elements of a JSON array read from a text stream one at a time: ("record", value) for each element that
    parses, ("malformed", error) for one that does not (skipped to where it ends), and a final ("truncated",
    characters) when the stream ends inside an element (a file cut off mid-record). Memory: one chunk plus the
    element being read."""
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def more() -> None:
        nonlocal buf, pos, eof
        data = f.read(max(chunk, len(buf) - pos))  # doubling: an element larger than a chunk costs O(its size)
        eof = not data
        buf, pos = buf[pos:] + data, 0

    opened = False
    while True:
        pos = _SEPARATORS.match(buf, pos).end()
        if pos == len(buf):
            if eof:
                if not opened:
                    raise WorkbookError("the file is empty", "point the source at a JSON array of records")
                return  # ended after a complete element (or before any): the closing ']' is missing, nothing lost
            more()
            continue
        if not opened:
            if buf[pos] != "[":
                raise WorkbookError(f"expected a JSON array of records, found {buf[pos:pos + 20]!r}",
                                    "point the source at a JSON array ([{...}, {...}]), or use kind: jsonl")
            opened = True
            pos += 1
            continue
        if buf[pos] == "]":
            return
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as e:
            end = _value_end(buf, pos)
            if end is None:
                if eof:
                    yield "truncated", len(buf) - pos
                    return
                more()
                continue
            yield "malformed", e.msg
            pos = end
            continue
        if end == len(buf) and not eof and not isinstance(value, dict | list):
            more()  # a number or literal at the end of the buffer may go on in the next chunk
            continue
        yield "record", value
        pos = end
