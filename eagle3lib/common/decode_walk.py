"""The walk of a greedy chain speculative decoder: from where it starts, each step accepts some draft tokens and
moves past them and the target's own token. Stage 06's offline replay and stage 05's validation walk the same way,
so their counts are the decoder's own (evaluate.decoder, train.walk).
"""

from __future__ import annotations


def decode_path(lengths_by_start: dict[int, int], first_start: int, last_index: int) -> list[tuple[int, int]]:
    """The (start, accepted) pairs a greedy chain decoder visits: start at the prompt's end, jump accepted + 1.

    first_start = n - 1 (the draft's first start is the position before the first generated token x_n);
    last_index = L - 1 (the last verified token). Replaying the decoder's walk on the same continuation gives the
    decoder's own counts: this is what makes the offline and embedded numbers comparable.
    """
    path = []
    i = first_start
    while i + 1 < last_index:
        a = lengths_by_start[i]
        path.append((i, a))
        i += a + 1
    return path
