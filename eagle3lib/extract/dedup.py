"""What "the same prompt" means, in one place: the rule that keeps evaluation prompts out of the training data.

Why one module: stage 02 drops every training conversation that shares a prompt with an evaluation prompt (the
held-out split and every `evaluate.benchmarks` set), and self_instruct and magpie drop every request the target
writes that does; both must mean the same thing by "shares".

The rule, on normalized text (`normalize`: case folded, every run of punctuation and whitespace one space):
- equal, or
- one contains the other as a run of whole words, when that run is long enough to be the same prompt rather than a
  common phrase: at least RUN_WORDS words, or at least MIN_WORDS words and half of the longer text ("what is a
  tuple" inside "explain: what is a tuple in Python?", or AlpacaEval's babysitter prompt inside a ShareGPT turn
  that adds a title, are leaks; "tell me a joke" inside a 22-word AlpacaEval prompt, or "thank you very much" inside
  a WritingBench one, are not: measured on ShareGPT against the four benchmarks, the plain 4-word rule dropped such
  phrases as often as real copies).

`EvalIndex` applies the rule to thousands of training turns against thousands of evaluation prompts without
comparing every pair (ShareGPT's 61k user turns against MT-Bench, AlpacaEval, Arena-Hard and WritingBench would be
~170M substring searches): a word-run containment of at least MIN_WORDS words implies that the shorter text's first
MIN_WORDS words appear as a shingle of the longer, so only those candidates are checked, with the same `contains`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MIN_WORDS = 4  # a shorter run is never a leak by containment (only by equality)
RUN_WORDS = 8  # a run this long is one whatever the length of the text around it
_NON_WORD = re.compile(r"[\W_]+")


def normalize(text: str) -> str:
    """Case, whitespace and punctuation folded: what 'the same prompt' means for dedup and eval leaks."""
    return _NON_WORD.sub(" ", text.casefold()).strip()


def contains(longer: str, shorter: str) -> bool:
    """`shorter` is a run of whole words of `longer` (both normalized), long enough to count (see the rule)."""
    n = shorter.count(" ") + 1
    return n >= MIN_WORDS and (n >= RUN_WORDS or 2 * n >= longer.count(" ") + 1) and f" {shorter} " in f" {longer} "


def overlaps(norm: str, eval_norms: Iterable[str]) -> bool:
    """Equal to, containing or contained in an evaluation prompt (all normalized): the rule, pair by pair."""
    return any(norm == e or contains(norm, e) or contains(e, norm) for e in eval_norms if e)


def _shingles(words: list[str]) -> set[str]:
    return set(map(" ".join, zip(*(words[i:] for i in range(MIN_WORDS)), strict=False)))


class EvalIndex:
    """Evaluation prompts grouped by name ("held_out", "mt_bench", ...), for `matches(text)`: the groups a training
    text overlaps under the rule above."""

    def __init__(self) -> None:
        self.exact: dict[str, set[str]] = {}  # normalized prompt -> groups
        self.first: dict[str, list[tuple[str, str]]] = {}  # first MIN_WORDS words -> [(prompt, group)]
        self.inside: dict[str, list[tuple[str, str]]] = {}  # every shingle of a prompt -> [(prompt, group)]

    def add(self, group: str, texts: Iterable[str]) -> EvalIndex:
        for text in texts:
            norm = normalize(text)
            if not norm or group in self.exact.get(norm, ()):
                continue
            self.exact.setdefault(norm, set()).add(group)
            words = norm.split(" ")
            if len(words) >= MIN_WORDS:
                self.first.setdefault(" ".join(words[:MIN_WORDS]), []).append((norm, group))
                for sh in _shingles(words):
                    self.inside.setdefault(sh, []).append((norm, group))
        return self

    def __len__(self) -> int:
        return len(self.exact)

    def matches(self, text: str) -> set[str]:
        """The groups with a prompt equal to, contained in, or containing `text`."""
        norm = normalize(text)
        if not norm:
            return set()
        found = set(self.exact.get(norm, ()))
        words = norm.split(" ")
        if len(words) < MIN_WORDS:
            return found
        shingles = _shingles(words)
        for sh in shingles & self.first.keys():  # an evaluation prompt inside the text
            found.update(g for e, g in self.first[sh] if g not in found and contains(norm, e))
        head = " ".join(words[:MIN_WORDS])  # the text inside an evaluation prompt
        found.update(g for e, g in self.inside.get(head, ()) if g not in found and contains(e, norm))
        return found
