"""Compatibility between the installed vLLM, speculators and transformers: a contract audit and a patch registry.

Each patch has a name, the reason, the contract it repairs, a detector (is it needed on THIS install? a behaviour
check where one is cheap), an idempotent apply and a revert. Patch modules live beside this file and register
themselves with `register`; `apply_all()` applies what is needed and returns a table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Patch:
    name: str
    why: str  # one sentence
    repairs: str  # name of the contract it repairs
    detect: Callable[[], bool]  # True when the patch is needed here (and applicable: its package is installed)
    apply: Callable[[], None]  # idempotent
    revert: Callable[[], None]
    stages: tuple[str, ...] = field(default_factory=tuple)  # stage ids that need it
    applied: bool = False


PATCHES: dict[str, Patch] = {}


def register(patch: Patch) -> Patch:
    PATCHES[patch.name] = patch
    return patch


def apply_patch(name: str) -> bool:
    """Apply one patch if its detector says it is needed; returns whether it is active afterwards."""
    patch = PATCHES[name]
    if not patch.applied and patch.detect():
        patch.apply()
        patch.applied = True
    return patch.applied


def revert_patch(name: str) -> None:
    patch = PATCHES[name]
    if patch.applied:
        patch.revert()
        patch.applied = False
