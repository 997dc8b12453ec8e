"""Stage 01 (notebooks/01_patches.ipynb): audit the contracts, apply the patches, audit again, write both tables, fail on what blocks.

Why a module: notebook 01 is a thin page over `run(stage)`; tests call `run` directly. The audit runs twice so the
tables show each contract before and after the patches: a behaviour probe (rotary op, hidden-states connector) that
turns from mismatch to ok is the proof the patch works on this install.

Note for later stages: patches live in memory. This stage applies them in ITS process to prove they work; every
process that runs vLLM or the speculators Trainer calls `eagle3lib.compat.apply_all()` itself (and vLLM workers
`worker_setup()`, see the package docstring).
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from eagle3lib.common import atomic
from eagle3lib.common.rundir import StageResult, StageRun
from eagle3lib.compat import apply_all, audit, check_required, required_tags
from eagle3lib.compat.contracts import AuditResult

_COLOURS = {"ok": "#d4edda", "repaired": "#d1ecf1", "applied": "#d1ecf1", "not needed": "#f1f3f5",
            "not installed": "#fff3cd", "mismatch": "#f8d7da", "error": "#f8d7da"}


def html_table(rows: list[dict[str, Any]], columns: list[str], status_key: str = "status",
               highlight: set[str] | None = None) -> str:
    """A plain HTML table, rows coloured by status; rows whose name is in `highlight` are bold (needed here)."""
    head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in columns)
    body = []
    for r in rows:
        status = str(r.get(status_key, ""))
        colour = next((v for k, v in _COLOURS.items() if status.startswith(k)), "#f8d7da" if "NOT" in status else "")
        weight = "font-weight:bold;" if highlight and r.get("name") in highlight else ""
        cells = "".join(f"<td style='text-align:left;vertical-align:top'>{html.escape(_fmt(r.get(c)))}</td>"
                        for c in columns)
        body.append(f"<tr style='background:{colour};{weight}'>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, list | tuple):
        return ", ".join(map(str, v))
    return str(v)


def audit_rows(before: list[AuditResult], after: list[AuditResult], tags: set[str]) -> list[dict[str, Any]]:
    """One row per contract. A contract a patch repaired keeps why it failed before ("before: …; after: …"): the
    H200 once repaired vLLM's hidden-states connector with the CPU one, and only the reason could tell why."""
    rows = []
    for b, a in zip(before, after, strict=True):
        detail = a.detail or b.detail
        if b.status != a.status and b.detail and b.detail != a.detail:
            detail = f"before: {b.detail}; after: {a.detail or a.status}"
        rows.append({"name": a.name, "needed here": bool(set(a.needs) & tags), "before patches": b.status,
                     "status": a.status, "detail": detail, "expect": a.expect, "symbol": a.symbol,
                     "stages": list(a.stages), "needs": list(a.needs), "repaired by": a.repaired_by})
    return rows


@dataclass
class CompatResult(StageResult):
    """Stage 01's result: the manifest's outputs and metrics, and the two tables notebook 01 shows."""

    tags: list[str] = field(default_factory=list)  # what this configuration needs (required_tags)
    audit: list[dict[str, Any]] = field(default_factory=list)  # one row per contract, before and after the patches
    patches: list[dict[str, Any]] = field(default_factory=list)  # one row per patch
    audit_html: str = ""
    patches_html: str = ""


def run(stage: StageRun) -> CompatResult:
    """Audit, apply, audit again; write patches/audit.json and patches/patches.json; raise WorkbookError naming
    every contract the configured backend needs that is still broken. The caller ends it with stage.finish(result)."""
    cfg = stage.cfg
    tags = required_tags(cfg)
    before = audit()
    patch_rows = apply_all()
    after = audit()
    rows = audit_rows(before, after, tags)
    audit_path = atomic.write_json(stage.rd.path("patches", "audit.json"),
                                   {"required_tags": sorted(tags), "contracts": rows})
    patches_path = atomic.write_json(stage.rd.path("patches", "patches.json"), {"patches": patch_rows})
    needed = {r["name"] for r in rows if r["needed here"]}
    # the statuses of the contracts this configuration needs: a CPU-only contract that cannot run on a CUDA build
    # is an "error" in its row, not a problem of this run
    count = {s: sum(r["status"] == s for r in rows if r["name"] in needed)
             for s in ("ok", "repaired", "mismatch", "error", "not installed")}
    result = CompatResult(
        outputs={"audit": audit_path, "patches": patches_path},
        metrics={"contracts": len(rows), "needed_here": len(needed), **{k.replace(" ", "_"): v for k, v in count.items()},
                 "patches_applied": [p["name"] for p in patch_rows if p["applied"]],
                 "patches_unverified": [p["name"] for p in patch_rows if p["applied"] and not p["verified"]]},
        tags=sorted(tags), audit=rows, patches=patch_rows,
        audit_html=html_table(rows, ["name", "needed here", "before patches", "status", "detail", "stages",
                                     "repaired by"], highlight=needed),
        patches_html=html_table(patch_rows, ["name", "status", "needed", "applied", "verified", "scope",
                                             "repairs", "why", "error"]),
    )
    check_required(after, tags)  # raises WorkbookError naming every blocking contract (JSONs are written already)
    return result
