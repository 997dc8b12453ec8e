"""Stage 04, part 2: the draft vocabulary (speculators' t2d / d2t maps) and how much of the data it covers.

Why a pruned vocabulary: the draft's lm_head over the full target vocabulary (152k for Qwen) costs more than the
rest of the draft; the k most frequent loss-masked training tokens cover most of what the target writes. The maps come
from speculators' own `build_vocab_mappings_from_distribution` (top-k by frequency, ties by id, padded with low ids),
so they are what `speculators train` would build itself from token_freq.pt:
    d2t.npy   int64 [k]: offsets, target_id = draft_id + d2t[draft_id]
    t2d.npy   bool [V]: True where a target token is in the draft vocabulary (k of them)
Coverage (share of loss-masked tokens whose id is in the vocabulary) is measured on the training tokens the vocabulary
was chosen from (optimistic) and on the held-out rows (honest).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle3lib.common import atomic, plots
from eagle3lib.common.errors import WorkbookError


def load_token_freq(path: str | Path, vocab_size: int) -> dict[int, int]:
    """token_freq.pt = {token_id: count} over loss-masked train tokens (loaded without unpickling code)."""
    try:
        freq = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise WorkbookError(f"{path} is missing", "rerun stage 02 (it writes token_freq.pt)") from None
    if not isinstance(freq, dict) or not freq:
        raise WorkbookError(f"{path} holds no token counts", "rerun stage 02 with more data (data.num_samples)")
    freq = {int(k): int(v) for k, v in freq.items()}
    bad = [k for k in freq if not 0 <= k < vocab_size]
    if bad:
        raise WorkbookError(f"{path} counts token ids {bad[:5]} outside the target vocabulary (size {vocab_size})",
                            "stage 02 ran with another tokenizer/target: rerun stage 02 for this target")
    return freq


def draft_order(freq: dict[int, int], vocab_size: int) -> np.ndarray:
    """All target ids in the order speculators' build_vocab_mappings_from_distribution picks them: seen tokens by
    count (ties by id), then unseen ids from 0 up. The draft vocabulary of size k is the first k (as a set)."""
    seen = sorted(freq, key=lambda t: (-freq[t], t))
    unseen = np.setdiff1d(np.arange(vocab_size), np.asarray(seen, dtype=np.int64), assume_unique=True)
    return np.concatenate([np.asarray(seen, dtype=np.int64), unseen])


def build_draft_vocab(freq: dict[int, int], draft_vocab_size: int, vocab_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [k] offsets, t2d bool [V]) from speculators' own function, k clipped to the vocabulary."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    k = min(draft_vocab_size, vocab_size)
    d2t, t2d = build_vocab_mappings_from_distribution(token_freq_dict=freq, draft_vocab_size=k,
                                                      target_vocab_size=vocab_size)
    if d2t.shape != (k,) or t2d.shape != (vocab_size,) or int(t2d.sum()) != k:
        raise WorkbookError(f"speculators built d2t {list(d2t.shape)} / t2d with {int(t2d.sum())} tokens for k={k}",
                            "report this: speculators' build_vocab_mappings_from_distribution changed behaviour")
    return d2t, t2d


def coverage_curve(counts_by_rank: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """Share of tokens whose rank (position in draft_order) is below k, for each k."""
    total = counts_by_rank.sum()
    cum = np.concatenate([[0], np.cumsum(counts_by_rank)])
    return cum[np.minimum(ks, len(counts_by_rank))] / max(total, 1)


def coverage_ks(vocab_size: int, chosen: int, points: int = 48) -> np.ndarray:
    ks = np.unique(np.concatenate([np.geomspace(1, vocab_size, points).round().astype(np.int64), [chosen]]))
    return ks[(ks >= 1) & (ks <= vocab_size)]


def val_token_counts(dataset_dir: Path, train_rows: int, val_rows: int, vocab_size: int) -> np.ndarray | None:
    """Counts per target id of the loss-masked tokens of the held-out rows (rows after train_rows)."""
    if not val_rows:
        return None
    from datasets import load_from_disk

    ds = load_from_disk(str(dataset_dir)).select(range(train_rows, train_rows + val_rows))
    counts = np.zeros(vocab_size, dtype=np.int64)
    for row in ds.select_columns(["input_ids", "loss_mask"]).with_format("numpy"):
        ids = np.asarray(row["input_ids"])[np.asarray(row["loss_mask"]).astype(bool)]
        np.add.at(counts, ids, 1)
    return counts


@dataclass
class DraftVocab:
    d2t: torch.Tensor
    t2d: torch.Tensor
    k: int
    vocab_size: int
    distinct_train_tokens: int
    ks: np.ndarray
    coverage_train: np.ndarray
    coverage_val: np.ndarray | None

    def coverage_at_k(self) -> tuple[float, float | None]:
        i = int(np.searchsorted(self.ks, self.k))
        return float(self.coverage_train[i]), (float(self.coverage_val[i]) if self.coverage_val is not None else None)


def make_draft_vocab(freq: dict[int, int], draft_vocab_size: int, vocab_size: int,
                     val_counts: np.ndarray | None = None) -> DraftVocab:
    """The maps plus the coverage curves; checks that speculators' chosen set is the first k of draft_order."""
    d2t, t2d = build_draft_vocab(freq, draft_vocab_size, vocab_size)
    k = d2t.shape[0]
    order = draft_order(freq, vocab_size)
    mine = np.zeros(vocab_size, dtype=bool)
    mine[order[:k]] = True
    if not np.array_equal(mine, t2d.numpy()):
        raise WorkbookError("the draft vocabulary speculators built differs from the frequency ranking",
                            "report this: speculators' build_vocab_mappings_from_distribution changed behaviour")
    counts = np.zeros(vocab_size, dtype=np.int64)
    counts[list(freq)] = list(freq.values())
    ks = coverage_ks(vocab_size, k)
    cov_val = coverage_curve(val_counts[order], ks) if val_counts is not None and val_counts.sum() else None
    return DraftVocab(d2t, t2d, k, vocab_size, len(freq), ks, coverage_curve(counts[order], ks), cov_val)


def write_draft_vocab(dv: DraftVocab, out_dir: Path) -> dict[str, Path]:
    """d2t.npy / t2d.npy in the form `speculators train --d2t-path/--t2d-path` np.loads, plus coverage.json."""
    out_dir = Path(out_dir)
    paths = {"d2t": out_dir / "d2t.npy", "t2d": out_dir / "t2d.npy", "coverage": out_dir / "coverage.json"}
    for name, arr in (("d2t", dv.d2t.numpy().astype(np.int64)), ("t2d", dv.t2d.numpy().astype(bool))):
        with atomic.atomic_path(paths[name], suffix=".npy") as tmp:
            np.save(tmp, arr)
    cov, cov_val = dv.coverage_at_k()
    atomic.write_json(paths["coverage"], {
        "k": dv.k, "vocab_size": dv.vocab_size, "distinct_train_tokens": dv.distinct_train_tokens,
        "coverage_train_at_k": cov, "coverage_val_at_k": cov_val, "ks": dv.ks.tolist(),
        "coverage_train": dv.coverage_train.tolist(),
        "coverage_val": None if dv.coverage_val is None else dv.coverage_val.tolist()})
    return paths


def plot_coverage(dv: DraftVocab, path: Path, close: bool = True):
    """Coverage vs k (log k), the chosen k marked, saved as PNG. Closed by default (the notebook shows the PNG, so
    the figure does not also pop up in whichever cell created it); returns the figure."""
    import matplotlib.pyplot as plt

    cov, cov_val = dv.coverage_at_k()
    fig, ax = plots.figure(figsize=(7, 4))
    ax.plot(dv.ks, dv.coverage_train, label="train tokens (token_freq.pt)")
    if dv.coverage_val is not None:
        ax.plot(dv.ks, dv.coverage_val, label="held-out rows", linestyle="--")
    ax.axvline(dv.k, color="gray", linestyle=":")
    label = f"k = {dv.k}: {cov:.1%} train" + (f", {cov_val:.1%} held-out" if cov_val is not None else "")
    ax.scatter([dv.k], [cov], color="C3", zorder=3, label=label)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft vocabulary size k (most frequent tokens first)")
    ax.set_ylabel("share of loss-masked tokens covered")
    ax.set_title(f"Draft vocabulary coverage (target vocab {dv.vocab_size}, {dv.distinct_train_tokens} seen)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    plots.save(fig, path)
    if close:
        plt.close(fig)
    return fig
