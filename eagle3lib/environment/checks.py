"""One row of stage 00's pass/warn/fail table."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Check:
    name: str
    status: str  # "pass" | "warn" | "fail"
    detail: str
