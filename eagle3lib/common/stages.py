"""The numbered stages: which notebook, which config sections each reads, which earlier stages it builds on.

Why a table: the runner, the manifests and the CLI all need the same facts. A stage exists when its notebook
exists: stages that are not built yet are simply absent (no placeholder notebooks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3lib.common.errors import WorkbookError

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
# set by a headless run (eagle3lib.runner) for its kernels: the run's folder of executed notebooks, from which a
# notebook's own links are read (evaluate.report.report_for_notebook)
EXECUTED_NOTEBOOKS_ENV = "EAGLE3_EXECUTED_NOTEBOOKS"


@dataclass(frozen=True)
class Stage:
    id: str  # "02"
    name: str  # "extract_hidden_states"
    sections: tuple[str, ...]  # config sections the stage itself reads (or single fields: "section.key")
    needs: tuple[str, ...]  # ids of stages whose outputs (manifests) it reads
    title: str

    @property
    def key(self) -> str:
        return f"{self.id}_{self.name}"

    @property
    def notebook(self) -> Path:
        return NOTEBOOK_DIR / f"{self.key}.ipynb"


ALL_STAGES: tuple[Stage, ...] = (
    # 00 and 02 read train.hidden_states: online and spool modes need (and write) shards for a few sample rows only
    Stage("00", "environment", ("target", "extract", "train.hidden_states"), (), "environment and GPU check"),
    Stage("01", "patches", ("target", "extract", "evaluate"), (), "contract audit and compatibility patches"),
    # 02 reads evaluate.benchmarks: it writes their prompts and drops the training conversations that overlap them
    Stage("02", "extract_hidden_states", ("run", "target", "data", "extract", "evaluate.benchmarks",
                                          "train.hidden_states"), (),
          "training data and hidden states"),
    Stage("03", "inspect_tensors", ("inspect",), ("02",), "validate and look at the hidden states"),
    Stage("04", "verifier_weights", ("verifier",), ("02",), "verifier embedding/lm_head/norm and draft vocabulary"),
    Stage("05", "train_draft", ("train",), ("02", "04"), "train the EAGLE-3 draft"),
    Stage("06", "evaluate_acceptance", ("evaluate",), ("02", "04", "05"),
          "acceptance length and speed; the report card"),
)
_BY_ID = {s.id: s for s in ALL_STAGES}


def available_stages() -> list[Stage]:
    """The stages whose notebook is in notebooks/."""
    return [s for s in ALL_STAGES if s.notebook.is_file()]


def get_stage(stage_id: str) -> Stage:
    if stage_id not in _BY_ID:
        raise WorkbookError(f"unknown stage {stage_id!r}", f"use one of {', '.join(_BY_ID)}")
    return _BY_ID[stage_id]


def lineage_sections(stage: Stage) -> tuple[str, ...]:
    """The config sections that shaped a stage's outputs: its own plus, recursively, those of what it builds on."""
    sections = set(stage.sections)
    for dep in stage.needs:
        sections |= set(lineage_sections(get_stage(dep)))
    return tuple(sorted(sections))


def parse_selection(text: str | None) -> list[Stage]:
    """'00,02-04' → those stages, in order, among the available ones. None/'' = all available stages."""
    available = available_stages()
    if not text:
        return available
    wanted: set[str] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = (p.strip().zfill(2) for p in part.split("-", 1))
            wanted |= {s.id for s in ALL_STAGES if lo <= s.id <= hi}
        else:
            wanted.add(part.zfill(2))
    for stage_id in sorted(wanted):
        stage = get_stage(stage_id)
        if stage not in available:
            raise WorkbookError(f"stage {stage.key} is not built yet (no {stage.notebook.name})",
                                f"choose among: {', '.join(s.id for s in available)}")
    return [s for s in available if s.id in wanted]
