"""Stage 02's training rows: a conversation as the chat template's tokens, the loss mask on its assistant turns, and
which replies are trained on.

`loss_mask` = 1 exactly on the characters of assistant turns, found by rendering prefixes of the conversation and
mapping character offsets to tokens (`assistant_spans`); rows are cut to data.max_length, and a reply that loops
(`repeated_share` above data.max_repeated_share) is left out of the loss. `eagle3lib.extract.prepare` calls
`training_rows` once it has the conversations.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from eagle3lib.common.config import DataSection
from eagle3lib.common.errors import WorkbookError

if TYPE_CHECKING:
    from eagle3lib.extract.prepare import Prepared


def render(tok, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The conversation as the target's chat template renders it (with the generation prompt: up to its reply)."""
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tok, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered with the chat template, and the character spans of its assistant turns.

    Why prefixes: chat templates differ in how they wrap turns, but every template we know renders a conversation's
    prefix as a prefix of its full rendering. The assistant turn i then spans the characters between
    render(messages[:i], generation prompt) and render(messages[:i+1]) — its text and end-of-turn marker, not the
    role header. The spans come out in order and disjoint.
    """
    text = render(tok, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_text = render(tok, messages[:i], add_generation_prompt=True)
        end_text = render(tok, messages[: i + 1])
        if not (text.startswith(start_text) and text.startswith(end_text) and len(start_text) <= len(end_text)):
            raise WorkbookError("the chat template does not render conversation prefixes as prefixes of the whole",
                                "use a tokenizer whose chat template is prefix-stable, or pre-tokenize the data")
        spans.append((len(start_text), len(end_text)))
    return text, spans


def span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 on each token whose characters overlap an assistant span (a token straddling a turn boundary counts), 0
    elsewhere and on tokens without characters. `spans` in order and disjoint: for each token the only span that can
    overlap it first is the first one ending after the token starts (a binary search, not a scan of every span)."""
    if not spans or not offsets:
        return [0] * len(offsets)
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = (np.asarray(x, dtype=np.int64) for x in zip(*spans, strict=True))
    first, last = off[:, 0], off[:, 1]
    j = np.minimum(np.searchsorted(ends, first, side="right"), len(spans) - 1)
    hit = (last > first) & (ends[j] > first) & (starts[j] < last)
    return hit.astype(np.int64).tolist()


def tokenize_conversation(tok, messages: list[dict[str, str]], max_length: int) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) for one conversation, truncated to max_length; loss_mask = 1 on the tokens of
    assistant turns only (`assistant_spans`, mapped to tokens by the tokenizer's character offsets)."""
    text, spans = assistant_spans(tok, messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"][:max_length], span_mask(enc["offset_mapping"], spans)[:max_length]


def tokenize_conversations(tok, convs: list[list[dict[str, str]]], threads: int | None = None,
                           chunk: int = 256) -> list[tuple[list[int], list[int]]]:
    """`tokenize_conversation` of every conversation, untruncated, with the encoding on `threads` threads (default:
    up to 8 cores): the fast tokenizer's Rust encoder releases the GIL, so chunks of texts encode side by side while
    the chat template renders here. TOKENIZERS_PARALLELISM stays off (the run's engines fork). The 1.5B's 4x data
    (54k conversations) spent ~80% of its data preparation in this step, one conversation at a time; threads made it
    about twice as fast on 2 CPU cores, more with more cores (docs/results.md)."""
    if not getattr(tok, "is_fast", False):  # no Rust encoder to share out: one conversation at a time
        return [tokenize_conversation(tok, c, 10**9) for c in convs]
    rendered = [assistant_spans(tok, c) for c in convs]
    # a copy of the Rust tokenizer without padding or truncation: transformers leaves on the one it wraps whatever
    # its last call asked for (a padded generate batch pads every text of a batch here to the longest)
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.no_padding()
    backend.no_truncation()
    texts = [t for t, _ in rendered]
    workers = threads or max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        batches = pool.map(lambda i: backend.encode_batch(texts[i:i + chunk], add_special_tokens=False),
                           range(0, len(texts), chunk))
        encs = [e for b in batches for e in b]
    return [(e.ids, span_mask(e.offsets, s)) for e, (_, s) in zip(encs, rendered, strict=True)]


def training_rows(d: DataSection, pool: list[dict[str, Any]], convs: list[list[dict[str, str]]], tok,
                  stats: dict[str, Any]) -> tuple[list[list[int]], list[list[int]], list, list]:
    """Token ids, loss masks, conversations and categories of the rows that keep trained-on tokens within
    data.max_length; a reply that loops (data.max_repeated_share) is left out of the loss, the conversation kept as
    context. What was dropped, cut, looping or masked goes into `stats`."""
    rows = []
    dropped = truncated = replies = masked = masked_tokens = 0
    looping = dict.fromkeys(LOOP_SHARES, 0)
    for rec, conv, (i, m) in zip(pool, convs, tokenize_conversations(tok, convs), strict=True):
        full_len = len(i)
        i, m = i[: d.max_length], m[: d.max_length]
        for a, b in reply_spans(m):
            share = repeated_share(i[a:b])
            replies += 1
            looping.update({x: looping[x] + 1 for x in LOOP_SHARES if share > x})
            if d.max_repeated_share is not None and share > d.max_repeated_share:
                m = m[:a] + [0] * (b - a) + m[b:]
                masked, masked_tokens = masked + 1, masked_tokens + b - a
        if sum(m) == 0:  # the prompt alone fills max_length, or every reply loops: nothing left to learn from
            dropped += 1
            continue
        truncated += full_len > d.max_length
        rows.append((i, m, conv, rec.get("category")))
    stats.update(dropped_rows=dropped, truncated_rows=truncated, replies=replies,
                 looping_replies={f"over {x}": c for x, c in looping.items()},
                 masked_replies=masked, masked_reply_tokens=masked_tokens)
    ids, masks, kept, cats = (list(col) for col in zip(*rows, strict=True)) if rows else ([], [], [], [])
    return ids, masks, kept, cats


LOOP_SHARES = (0.3, 0.5)  # the repeated_share levels stage 02 counts replies above (its statistics' `looping_replies`)


def reply_spans(loss_mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of trained-on tokens: one assistant reply each (a chat template puts the next turn's
    header, never trained on, between two replies)."""
    spans, start = [], None
    for k, v in enumerate([*loss_mask, 0]):
        if v and start is None:
            start = k
        elif not v and start is not None:
            spans.append((start, k))
            start = None
    return spans


def repeated_share(tokens: list[int], n: int = 8) -> float:
    """The share of a reply's n-grams that occur in it more than once: near 0 for ordinary text, high for a greedy
    reply stuck in a loop up to the token limit. Measured per reply: across a conversation's replies, code repeated
    from one turn to the next would count as a loop."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    counts: dict[tuple[int, ...], int] = {}
    for g in grams:
        counts[g] = counts.get(g, 0) + 1
    return sum(c for c in counts.values() if c > 1) / len(grams)


def example_row(prepared: Prepared, min_reply: int = 32, max_repeated: float = 0.3) -> int:
    """A training row to show as the example of what is trained on: the first whose trained-on tokens are at least
    `min_reply` long and none of whose replies loops (`repeated_share` at most `max_repeated`); row 0 where none is."""
    for i in range(prepared.n_train):
        ids, spans = prepared.input_ids[i], reply_spans(prepared.loss_mask[i])
        if (sum(b - a for a, b in spans) >= min_reply
                and all(repeated_share(ids[a:b]) <= max_repeated for a, b in spans)):
            return i
    return 0


def mask_html(tok, input_ids: list[int], loss_mask: list[int], limit: int = 400) -> str:
    """One row as HTML: trained-on tokens (loss_mask = 1) highlighted — the quickest check that the mask is right."""
    import html

    parts = []
    for t, m in zip(input_ids[:limit], loss_mask[:limit], strict=True):
        piece = html.escape(tok.decode([t])).replace("\n", "↵<br>")
        style = "background:#c8f7c5" if m else "color:#777"
        parts.append(f'<span style="{style}">{piece}</span>')
    more = f" … (+{len(input_ids) - limit} tokens)" if len(input_ids) > limit else ""
    return ('<div style="font-family:monospace;font-size:12px;line-height:1.6">' + "".join(parts) + more + "</div>")
