"""Stage 03's statistics per layer slot, as mergeable accumulators (eagle3lib.inspect_tensors runs the pass).

Running count/mean/M2 with Chan et al.'s parallel update: norms, per-dimension mean/std, max |value| and outlier
dimensions, cosine similarity between slots, norm against token position (power-of-two buckets), and a norm
histogram on fixed log10 bins. Mergeable means two halves merged give the numbers of one pass, so the result does
not depend on chunking, and sharding the pass over workers later changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

CHUNK_TOKENS = 512  # tokens converted to float64 at once: bounds memory for long shards and wide models
HIST_LOG10 = (-4.0, 7.0)  # norm histogram range (log10), fixed so histograms of two halves add up exactly
HIST_BINS = 440  # 40 bins per decade; plus an underflow bin (zero norms) and an overflow bin
POS_BUCKETS = 40  # bucket 0 = position 0, bucket k = positions [2^(k-1), 2^k)
TOP_OUTLIERS = 8


@dataclass
class Moments:
    """Running count/mean/M2 of any shape (float64), merged with Chan et al.'s parallel formula."""

    count: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor

    @classmethod
    def zeros(cls, *shape: int) -> Moments:
        z = torch.zeros(shape, dtype=torch.float64)
        return cls(z.clone(), z.clone(), z.clone())

    @classmethod
    def of(cls, x: torch.Tensor) -> Moments:
        """Moments over dim 0 of a float64 batch."""
        mean = x.mean(0)
        return cls(torch.full_like(mean, x.shape[0]), mean, ((x - mean) ** 2).sum(0))

    @classmethod
    def of_groups(cls, x: torch.Tensor, group: torch.Tensor, n_groups: int) -> Moments:
        """Moments of the rows of x [N, ...] per group id (group [N] long): shape [n_groups, ...]."""
        shape = (n_groups, *x.shape[1:])
        count = torch.zeros(shape, dtype=torch.float64).index_add_(0, group, torch.ones_like(x))
        mean = torch.zeros(shape, dtype=torch.float64).index_add_(0, group, x) / count.clamp_min(1)
        m2 = torch.zeros(shape, dtype=torch.float64).index_add_(0, group, (x - mean[group]) ** 2)
        return cls(count, mean, m2)

    def merge(self, other: Moments) -> Moments:
        n = self.count + other.count
        safe = n.clamp_min(1)
        delta = other.mean - self.mean
        return Moments(n, self.mean + delta * (other.count / safe),
                       self.m2 + other.m2 + delta**2 * self.count * other.count / safe)

    @property
    def std(self) -> torch.Tensor:
        """Population standard deviation (0 where nothing was counted)."""
        return (self.m2 / self.count.clamp_min(1)).sqrt()


def position_bucket(pos: torch.Tensor) -> torch.Tensor:
    """0 for position 0, k for positions [2^(k-1), 2^k): the first tokens (attention sinks) stay visible."""
    b = torch.zeros_like(pos)
    nz = pos > 0
    b[nz] = torch.floor(torch.log2(pos[nz].double())).long() + 1
    return b.clamp_max(POS_BUCKETS - 1)


def bucket_label(k: int) -> str:
    if k == 0:
        return "0"
    lo, hi = 2 ** (k - 1), 2**k - 1
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


@dataclass
class SlotStats:
    """Everything stage 03 reports per layer slot, as mergeable accumulators. Add shards with `update`."""

    n_slots: int
    hidden_size: int
    shards: int = 0
    tokens: int = 0
    norm: Moments = None  # type: ignore[assignment]  # [S] token L2 norms
    dim: Moments = None  # type: ignore[assignment]  # [S, H] per-dimension values
    max_abs: torch.Tensor = None  # type: ignore[assignment]  # [S, H]
    cos: Moments = None  # type: ignore[assignment]  # [S, S] per-token cosine between slots
    pos: Moments = None  # type: ignore[assignment]  # [POS_BUCKETS, S] norms by position bucket
    hist: torch.Tensor = None  # type: ignore[assignment]  # [S, HIST_BINS + 2] norm histogram (log10 bins)

    def __post_init__(self) -> None:
        s, h = self.n_slots, self.hidden_size
        self.norm = Moments.zeros(s) if self.norm is None else self.norm
        self.dim = Moments.zeros(s, h) if self.dim is None else self.dim
        self.max_abs = torch.zeros(s, h, dtype=torch.float64) if self.max_abs is None else self.max_abs
        self.cos = Moments.zeros(s, s) if self.cos is None else self.cos
        self.pos = Moments.zeros(POS_BUCKETS, s) if self.pos is None else self.pos
        self.hist = torch.zeros(s, HIST_BINS + 2, dtype=torch.int64) if self.hist is None else self.hist

    def update(self, hidden_states: torch.Tensor) -> None:
        """Add one shard [T, S, H] (any float dtype), in chunks of CHUNK_TOKENS tokens."""
        edges = torch.linspace(*HIST_LOG10, HIST_BINS + 1, dtype=torch.float64)
        for start in range(0, hidden_states.shape[0], CHUNK_TOKENS):
            x = hidden_states[start:start + CHUNK_TOKENS].to(torch.float64)
            norms = x.norm(dim=-1)  # [t, S]
            self.norm = self.norm.merge(Moments.of(norms))
            self.dim = self.dim.merge(Moments.of(x))
            self.max_abs = torch.maximum(self.max_abs, x.abs().amax(0))
            unit = x / norms.clamp_min(1e-30).unsqueeze(-1)
            self.cos = self.cos.merge(Moments.of(torch.einsum("tah,tbh->tab", unit, unit)))
            buckets = position_bucket(torch.arange(start, start + x.shape[0]))
            self.pos = self.pos.merge(Moments.of_groups(norms, buckets, POS_BUCKETS))
            idx = torch.bucketize(norms.log10(), edges, right=True)  # 0 = below range (incl. zero), last = above
            for s in range(self.n_slots):
                self.hist[s] += torch.bincount(idx[:, s], minlength=HIST_BINS + 2)
            self.tokens += x.shape[0]
        self.shards += 1

    def merge(self, other: SlotStats) -> SlotStats:
        """The statistics of both inputs together, as if they had been one pass."""
        return SlotStats(self.n_slots, self.hidden_size, self.shards + other.shards, self.tokens + other.tokens,
                         self.norm.merge(other.norm), self.dim.merge(other.dim),
                         torch.maximum(self.max_abs, other.max_abs), self.cos.merge(other.cos),
                         self.pos.merge(other.pos), self.hist + other.hist)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat tensors (for stats.safetensors and for comparing two passes)."""
        out = {"shards": torch.tensor([self.shards]), "tokens": torch.tensor([self.tokens]),
               "max_abs": self.max_abs, "hist": self.hist}
        for name in ("norm", "dim", "cos", "pos"):
            m: Moments = getattr(self, name)
            out |= {f"{name}.count": m.count, f"{name}.mean": m.mean, f"{name}.m2": m.m2}
        return {k: v.contiguous() for k, v in out.items()}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> SlotStats:
        def mom(name: str) -> Moments:
            return Moments(t[f"{name}.count"], t[f"{name}.mean"], t[f"{name}.m2"])

        n_slots, hidden = t["max_abs"].shape
        return cls(n_slots, hidden, int(t["shards"][0]), int(t["tokens"][0]), mom("norm"), mom("dim"), t["max_abs"],
                   mom("cos"), mom("pos"), t["hist"])

    def summary(self, layer_ids: list[int], outlier_factor: float = 8.0) -> dict[str, Any]:
        """JSON-ready numbers: per slot, the slot-to-slot cosines, and norm by position bucket."""
        n = self.n_slots
        dim_std = self.dim.std
        per_slot = []
        for s in range(n):
            max_abs = self.max_abs[s]
            median = float(max_abs.median()) or 1e-30
            order = torch.argsort(max_abs, descending=True)[:TOP_OUTLIERS]
            outliers = [{"dim": int(d), "max_abs": round(float(max_abs[d]), 4),
                         "ratio_to_median": round(float(max_abs[d]) / median, 2)}
                        for d in order if float(max_abs[d]) > outlier_factor * median]
            per_slot.append({
                "slot": s, "layer_id": layer_ids[s] if s < len(layer_ids) else None,
                "role": "final (pre-norm)" if s == n - 1 else "aux",
                "norm_mean": float(self.norm.mean[s]), "norm_std": float(self.norm.std[s]),
                "dim_mean_abs_mean": float(self.dim.mean[s].abs().mean()),
                "dim_std_median": float(dim_std[s].median()), "dim_std_max": float(dim_std[s].max()),
                "max_abs": float(max_abs.max()), "max_abs_dim": int(max_abs.argmax()),
                "max_abs_median": median, "outlier_dims": outliers,
                "cos_to_next": float(self.cos.mean[s, s + 1]) if s + 1 < n else None,
            })
        used = [k for k in range(POS_BUCKETS) if float(self.pos.count[k, 0]) > 0]
        return {
            "shards": self.shards, "tokens": self.tokens, "slots": per_slot,
            "cos_matrix": [[round(float(c), 6) for c in row] for row in self.cos.mean],
            "cos_consecutive": [float(self.cos.mean[s, s + 1]) for s in range(n - 1)],
            "cos_last_aux_final": float(self.cos.mean[n - 2, n - 1]) if n >= 2 else None,
            "norm_by_position": [{"positions": bucket_label(k), "tokens": int(self.pos.count[k, 0]),
                                  "mean": [float(v) for v in self.pos.mean[k]],
                                  "std": [float(v) for v in self.pos.std[k]]} for k in used],
        }
