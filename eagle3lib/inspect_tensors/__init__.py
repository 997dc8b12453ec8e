"""Stage 03 (notebooks/03_inspect_tensors.ipynb): validate every hidden-state shard on disk and summarise what the
layer slots hold, before training.

"It ran without errors" is not "it produced correct output". This module reads stage 02's shards once, in a
streaming pass (one shard in memory at a time, long shards in token chunks), and

- validates every shard: it opens, has the two keys, shape [T, n_aux+1, H], the recorded dtype, token ids equal to
  the dataset row, finite values (all via `eagle3lib.common.shards`, the same checks the writer ran), plus what only a look
  at the values shows: no all-zero layer slot, no two identical slots (how a wrong layer index usually shows), and
  lengths matching the row's `seq_len`;
- accumulates statistics per layer slot with mergeable running moments (eagle3lib.inspect_tensors.stats): norms,
  per-dimension mean/std, max |value| and outlier dimensions, cosine similarity between slots, and norm against
  token position; the figures are drawn from them (eagle3lib.inspect_tensors.figures).

Sampled mode (`inspect.sample_shards`) computes the statistics on a seeded random subset and says so in the report;
validation always covers every shard. Online and spool modes (`train.hidden_states`): stage 02 wrote shards for its
sample rows only (`shards.shard_rows`), so validation and statistics cover those, and the report's mode says so
(docs/capture.md#online-hidden-states). Same data and config in, same numbers out, whichever backend wrote the shards.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from eagle3lib.common import atomic, shards
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import StageResult, StageRun

# The statistics and the figures live in their own modules; their names stay importable from here.
from eagle3lib.inspect_tensors.figures import FIGURES as FIGURES
from eagle3lib.inspect_tensors.figures import fig_cos_heatmap as fig_cos_heatmap
from eagle3lib.inspect_tensors.figures import fig_dim_std as fig_dim_std
from eagle3lib.inspect_tensors.figures import fig_example_heatmap as fig_example_heatmap
from eagle3lib.inspect_tensors.figures import fig_norm_by_position as fig_norm_by_position
from eagle3lib.inspect_tensors.figures import fig_norm_hist as fig_norm_hist
from eagle3lib.inspect_tensors.figures import load_example as load_example
from eagle3lib.inspect_tensors.figures import make_figure as make_figure
from eagle3lib.inspect_tensors.stats import CHUNK_TOKENS as CHUNK_TOKENS
from eagle3lib.inspect_tensors.stats import Moments as Moments
from eagle3lib.inspect_tensors.stats import SlotStats as SlotStats
from eagle3lib.inspect_tensors.stats import bucket_label as bucket_label
from eagle3lib.inspect_tensors.stats import position_bucket as position_bucket

# how a problem string is counted in the report (first match wins)
_KINDS = (
    ("missing", "missing file"), ("unreadable", "unreadable file"), ("missing keys", "missing keys"),
    ("shape", "wrong shape"), ("dtype", "wrong dtype"), ("token_ids differ", "token ids differ from the row"),
    ("token_ids must", "wrong token_ids tensor"), ("NaN", "NaN or inf"), ("all zeros", "all-zero slot"),
    ("identical", "duplicated slots"), ("seq_len", "length mismatch"), ("loss_mask", "length mismatch"),
    ("empty", "empty sequence"),
)


def problem_kind(problem: str) -> str:
    for needle, kind in _KINDS:
        if needle in problem:
            return kind
    return "other"


# ----------------------------------------------------------------------------------------------------------------
# validation


def spec_from_manifest(metrics: dict[str, Any]) -> tuple[shards.ShardSpec, list[int]]:
    """The shard spec stage 02 recorded (slots = aux ids + final id, hidden size, stored dtype) and the layer ids."""
    try:
        layer_ids = [int(i) for i in metrics["layer_ids"]]
        spec = shards.spec_from_metrics(metrics)
    except (KeyError, TypeError, ValueError) as e:
        raise WorkbookError(f"stage 02's manifest lacks a usable {e} in its metrics (layer_ids, hidden_size, dtype)",
                            "rerun stage 02 with this version of the workbook") from None
    return spec, layer_ids


def slot_problems(hidden_states: torch.Tensor, layer_ids: list[int] | None = None) -> list[str]:
    """What only the values show: an all-zero slot, or two identical slots (a layer captured twice).

    Compared in float32 token chunks: exact for bf16/fp16 (the cast is lossless) and much faster than bf16 ops on a
    CPU, with memory bounded by the chunk; bytes (an FP8 shard as stored, `check_shard`) as they are.
    """
    n_tok, n_slots = hidden_states.shape[0], hidden_states.shape[1]
    name = (lambda s: f"slot {s} (layer {layer_ids[s]})") if layer_ids else (lambda s: f"slot {s}")
    nonzero = torch.zeros(n_slots, dtype=torch.bool)
    same = torch.ones(n_slots, n_slots, dtype=torch.bool)
    for start in range(0, n_tok, CHUNK_TOKENS):
        x = hidden_states[start:start + CHUNK_TOKENS]
        x = (x if x.dtype == torch.uint8 else x.to(torch.float32)).transpose(0, 1).reshape(n_slots, -1)
        words = x.view(torch.int64) if x.dtype == torch.uint8 and x.shape[1] % 8 == 0 else x  # bytes 8 at a time
        nonzero |= words.ne(0).any(dim=1)
        for a in range(n_slots):
            for b in range(a + 1, n_slots):
                if same[a, b]:
                    same[a, b] = torch.equal(x[a], x[b])
    zero = [s for s in range(n_slots) if not nonzero[s]]
    out = [f"{name(s)} is all zeros" for s in zero]
    for a in range(n_slots):
        for b in range(a + 1, n_slots):
            if a not in zero and b not in zero and same[a, b]:
                out.append(f"{name(a)} and {name(b)} are identical (a wrong layer index?)")
    return out


def check_shard(path: Path, row_ids: list[int] | torch.Tensor, seq_len: int | None, spec: shards.ShardSpec,
                layer_ids: list[int] | None = None, loss_mask_len: int | None = None, need_states: bool = True
                ) -> tuple[list[str], torch.Tensor | None]:
    """(problems, hidden_states): `shards.check_shard_file`'s checks plus slots and lengths, reading the file once.

    The file is read once because stage 03 also needs the tensor for statistics; the open/keys handling is the same
    as `shards.check_shard_file` and the tensor checks are `shards.problems` itself. The tensor comes back only
    when the shard is valid and `need_states`. An FP8 shard whose states are not needed is checked as stored
    (`shards.fp8_value_problems`; slots compared byte for byte, exact since a token's scale is shared by its
    slots): the same verdict without dequantizing 39 GB (on the 1.5B recipe's shards, stage 03 took 161 s
    that way).
    """
    if not path.is_file():
        return ["missing"], None
    try:
        data = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        return [f"unreadable ({e.__class__.__name__}: {' '.join(str(e).split())[:80]})"], None
    stored = shards.format_problems(data, spec)
    if stored:
        return stored, None
    as_stored = spec.fp8 and not need_states
    if as_stored:
        token_ids, raw = data["token_ids"], data["hidden_states"]
        found = shards.problems(token_ids, raw, row_ids, replace(spec, dtype=raw.dtype), values=False)
        if not found:
            found = shards.fp8_value_problems(data)
        hidden = raw.view(torch.uint8)  # for the slot checks: zero bytes are zeros, equal bytes equal values
    else:
        data = shards.dequantize(data, spec.dtype)
        token_ids, hidden = data["token_ids"], data["hidden_states"]
        found = shards.problems(token_ids, hidden, row_ids, spec)
    n_tok = token_ids.shape[0] if token_ids.dim() == 1 else -1
    if seq_len is not None and n_tok != seq_len:
        found.append(f"{n_tok} tokens but the row's seq_len is {seq_len}")
    if loss_mask_len is not None and loss_mask_len != len(row_ids):
        found.append(f"loss_mask has {loss_mask_len} entries for {len(row_ids)} input_ids")
    if not found and n_tok == 0:
        found.append("empty sequence (0 tokens)")
    if not found:
        found += slot_problems(hidden, layer_ids)
    return found, (hidden if not found and not as_stored else None)


@dataclass
class Validation:
    """What the pass found: counts, every invalid index, the first offending samples in full, stray files."""

    checked: int = 0
    invalid: dict[int, list[str]] = field(default_factory=dict)
    stray: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.invalid

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for found in self.invalid.values():
            for kind in sorted({problem_kind(p) for p in found}):
                out[kind] = out.get(kind, 0) + 1
        return out

    def summary(self, first: int = 10) -> dict[str, Any]:
        return {"checked": self.checked, "valid": self.checked - len(self.invalid), "invalid": len(self.invalid),
                "problem_counts": self.counts(), "invalid_indices": sorted(self.invalid),
                "first_invalid": [{"index": i, "problems": self.invalid[i]} for i in sorted(self.invalid)[:first]],
                "stray_files": self.stray}


def require_valid(validation: Validation, rerun: str = "eagle3 run --config <config> --run <run> --stages 02-03",
                  first: int = 5) -> None:
    """Stop the stage when any shard is invalid: one line with the indices, what is wrong, and the command that
    regenerates them (`rerun`: StageRun.command, the run as it was opened)."""
    if validation.ok:
        return
    idx = sorted(validation.invalid)
    shown = "; ".join(f"hs_{i}: {', '.join(validation.invalid[i])}" for i in idx[:first])
    more = f" (+{len(idx) - first} more, indices {idx[:50]})" if len(idx) > first else ""
    raise WorkbookError(
        f"{len(idx)} of {validation.checked} hidden-state shards are invalid — {shown}{more}",
        f"{rerun} (stage 02 keeps the valid shards and redoes these; inspect/report.json lists every problem)",
    )


# ----------------------------------------------------------------------------------------------------------------
# the pass


@dataclass
class Inspection:
    """The result of one pass: validation of every shard and statistics of the (sampled) valid ones."""

    dataset_dir: Path
    spec: shards.ShardSpec
    layer_ids: list[int]
    rows: int
    validation: Validation
    stats: SlotStats
    stats_indices: list[int] | None  # None = every shard
    seed: int
    online_rows: list[int] | None = None  # online and spool modes: the only rows with a shard
    hidden_states: str = "offline"  # stage 02's train.hidden_states (the mode's name in the report)

    @property
    def mode(self) -> str:
        if self.online_rows is not None:
            n = len(self.online_rows)
            who = "stage 05 computes" if self.hidden_states == "online" else "stage 05's spool producer computes"
            head = (f"{self.hidden_states}: the {n} sample shards stage 02 wrote (train.hidden_states: "
                    f"{self.hidden_states}; rows {self.online_rows[:8]}{' ...' if n > 8 else ''}) of {self.rows} "
                    f"rows; {who} the states of every row")
            if self.stats_indices is None:
                return head
            return f"{head}; statistics on {len(self.stats_indices)} of them chosen at random (seed {self.seed})"
        if self.stats_indices is None:
            return f"all {self.rows} shards"
        return f"sampled: {len(self.stats_indices)} of {self.rows} shards chosen at random (seed {self.seed})"

    def report(self, outlier_factor: float = 8.0, first: int = 10) -> dict[str, Any]:
        return {
            "dataset": str(self.dataset_dir),
            "spec": {"n_slots": self.spec.n_slots, "hidden_size": self.spec.hidden_size,
                     "dtype": str(self.spec.dtype).removeprefix("torch."), "layer_ids": self.layer_ids},
            "validation": self.validation.summary(first),
            "statistics": {"mode": self.mode, "sampled": self.stats_indices is not None,
                           "online_rows": self.online_rows,
                           "sample_indices": self.stats_indices, "outlier_factor": outlier_factor,
                           **self.stats.summary(self.layer_ids, outlier_factor)},
        }


def choose_sample(rows: int, sample_shards: int | None, seed: int) -> list[int] | None:
    """A sorted seeded subset of row indices, or None when every shard is used."""
    if sample_shards is None or sample_shards >= rows:
        return None
    if sample_shards < 1:
        raise WorkbookError(f"inspect.sample_shards={sample_shards} must be at least 1",
                            "set it to a positive number, or null for every shard")
    return sorted(random.Random(seed).sample(range(rows), sample_shards))


def open_dataset(dataset_dir: Path):
    from datasets import load_from_disk

    try:
        ds = load_from_disk(str(dataset_dir))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise WorkbookError(f"cannot open the dataset {dataset_dir} ({e.__class__.__name__})",
                            "rerun stage 02 for this run (it writes dataset/ and its shards)") from None
    if "input_ids" not in ds.column_names:
        raise WorkbookError(f"dataset {dataset_dir} has no input_ids column", "rerun stage 02 for this run")
    return ds


def scan(dataset_dir: str | Path, spec: shards.ShardSpec, layer_ids: list[int], *, sample_shards: int | None = None,
         seed: int = 0, indices: list[int] | None = None, progress: bool = True, threads: int | None = 1,
         hidden_states: str = "offline") -> Inspection:
    """One streaming pass: validate every shard (or `indices`: the sample rows of an online or spool stage 02,
    whose train.hidden_states is `hidden_states`), add valid ones to the statistics (all, or a seeded sample of
    them).

    Shards are visited in index order whatever is sampled, so the same data gives the same numbers. `threads` sets
    torch's CPU threads for the pass only (restored after): per-shard tensors are small, and on a busy machine
    OpenMP threads waiting for each other made the demo's pass 12x slower with 2 threads than with 1.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _scan(Path(dataset_dir), spec, layer_ids, sample_shards, seed, indices, progress, hidden_states)
    finally:
        torch.set_num_threads(before)


def _scan(dataset_dir: Path, spec: shards.ShardSpec, layer_ids: list[int], sample_shards: int | None, seed: int,
          indices: list[int] | None, progress: bool, hidden_states: str) -> Inspection:
    from tqdm.auto import tqdm

    ds = open_dataset(dataset_dir)
    columns = [c for c in ("input_ids", "seq_len", "loss_mask") if c in ds.column_names]
    ds = ds.select_columns(columns).with_format(None)  # plain Python values whatever format stage 02 saved
    rows = len(ds)
    wanted = list(range(rows)) if indices is None else sorted(indices)
    picked = choose_sample(len(wanted), sample_shards, seed)  # positions in `wanted` (= rows when indices is None)
    sample = None if picked is None else [wanted[j] for j in picked]
    in_stats = set(wanted if sample is None else sample)
    total = int(sum(ds["seq_len"])) if "seq_len" in columns and indices is None else None
    validation, stats = Validation(), SlotStats(spec.n_slots, spec.hidden_size)
    with tqdm(total=total, unit="tok", unit_scale=True, desc="03 inspect", disable=not progress) as bar:
        for i in wanted:
            row = ds[i]
            found, hidden = check_shard(shards.shard_path(dataset_dir, i), row["input_ids"], row.get("seq_len"), spec,
                                        layer_ids, len(row["loss_mask"]) if "loss_mask" in row else None,
                                        need_states=i in in_stats)
            validation.checked += 1
            if found:
                validation.invalid[i] = found
            elif i in in_stats:
                stats.update(hidden)
            bar.update(len(row["input_ids"]))
            bar.set_postfix(invalid=len(validation.invalid), refresh=False)
    validation.stray = stray_files(dataset_dir, rows)
    return Inspection(dataset_dir, spec, layer_ids, rows, validation, stats, sample, seed,
                      None if indices is None else wanted, hidden_states)


def stray_files(dataset_dir: Path, rows: int) -> list[str]:
    """Shard files with no dataset row (a leftover of an earlier, larger run): reported, not fatal."""
    out = []
    for p in sorted(shards.shard_dir(dataset_dir).glob("hs_*.safetensors")):
        stem = p.stem.removeprefix("hs_")
        if not stem.isdigit() or int(stem) >= rows:
            out.append(p.name)
    return out


def write_outputs(result: Inspection, out_dir: Path, outlier_factor: float = 8.0, first: int = 10
                  ) -> dict[str, Path]:
    """inspect/report.json (validation + summary) and inspect/stats.safetensors (the full accumulators)."""
    out_dir = Path(out_dir)
    report = atomic.write_json(out_dir / "report.json", result.report(outlier_factor, first))
    stats_path = out_dir / "stats.safetensors"
    with atomic.atomic_path(stats_path, suffix=".safetensors") as tmp:
        save_file(result.stats.tensors(), str(tmp))
    return {"report": report, "stats": stats_path}


def manifest_metrics(result: Inspection) -> dict[str, Any]:
    summary = result.stats.summary(result.layer_ids)
    return {"shards": result.validation.checked, "invalid": len(result.validation.invalid),
            "stats_shards": result.stats.shards, "sampled": result.stats_indices is not None,
            "online": result.online_rows is not None,
            "tokens": result.stats.tokens, "norm_mean": [round(s["norm_mean"], 6) for s in summary["slots"]],
            "cos_consecutive": [round(c, 6) for c in summary["cos_consecutive"]],
            "cos_last_aux_final": summary["cos_last_aux_final"]}



@dataclass
class InspectResult(StageResult):
    """Stage 03's result: the manifest's outputs and metrics, and the pass itself (validation and statistics)."""

    inspection: Inspection | None = None


def scan_stage(stage: StageRun) -> InspectResult:
    """Step 1: one pass over stage 02's shards; inspect/report.json and inspect/stats.safetensors written (also when
    shards are invalid, so the report names them)."""
    cfg = stage.cfg.inspect
    metrics = stage.rd.read_manifest("02")["metrics"]
    spec, layer_ids = spec_from_manifest(metrics)
    result = scan(stage.rd.output("02", "dataset"), spec, layer_ids, sample_shards=cfg.sample_shards,
                  seed=stage.cfg.run.seed, threads=cfg.threads,
                  indices=shards.shard_rows(metrics, 0) if shards.sampled(metrics) else None,
                  hidden_states=metrics.get("hidden_states", "offline"))
    outputs: dict[str, Any] = write_outputs(result, stage.rd.path("inspect"), cfg.outlier_factor, cfg.report_first)
    return InspectResult(outputs, manifest_metrics(result), result)


def add_figure(stage: StageRun, result: InspectResult, name: str) -> Path:
    """Step 3, one figure at a time: drawn, saved, and recorded among the stage's outputs."""
    path = make_figure(result.inspection, name, stage.rd, stage.cfg.inspect.example_index)
    result.outputs[f"figure_{name}"] = path
    return path


def run(stage: StageRun) -> InspectResult:
    """The whole stage without a notebook (tests, scripts): scan and write the report, fail on invalid shards, the
    figures. The notebook runs the same steps one cell at a time; the caller ends it with stage.finish(result)."""
    result = scan_stage(stage)
    require_valid(result.inspection.validation, stage.command("02-03"))
    for name in FIGURES:
        add_figure(stage, result, name)
    return result
