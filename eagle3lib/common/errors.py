"""The one exception type a user sees for a mistake they can fix.

Why: a bad config, a missing file or an incompatible install must surface as one line that names the problem and
the fix, not as a traceback from deep inside a library. Everything the workbook raises on purpose is a
`WorkbookError`; the CLI prints its message alone, and notebooks show it as the cell's error.
"""

from __future__ import annotations


class WorkbookError(Exception):
    """A problem the user can fix: `problem` says what is wrong, `fix` what to do about it."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} — fix: {fix}" if fix else problem)


class StageFailed(WorkbookError):
    """A stage's notebook failed while it ran (`eagle3 run` exits 1 for it; a mistake caught before exits 2)."""
