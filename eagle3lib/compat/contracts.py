"""The contract audit: every signature, attribute and behaviour the workbook relies on, checked in one pass.

Why: each incompatibility between vLLM, speculators and transformers used to surface one at a time, each after a
long model load, and one (the reply shape of `collective_rpc`) silently corrupted the data. A contract names the
package, the symbol, what is expected of it and which stages need it; `audit()` checks them all, before any model
loads, and returns every result (ok / mismatch / repaired / not installed / error) without stopping at the first.

Kinds of checks (all cheap: imports plus at most a few milliseconds of compute):
    signature  `inspect.signature` of a function or method: named parameters in order, keywords present
    attribute  a class, field or registry entry exists
    source     the module's source is parsed (never imported): for modules that cannot import here (vision
               models need torchvision, which has no CPU build) but whose structure still matters
    probe      a behaviour probe: the real code runs on a tiny input (e.g. the CPU rotary op on a 3-D tensor)

`needs` tags say which configurations rely on a contract (see `required_tags`): a broken contract blocks a run
only if the run's configuration needs it and no applied patch repairs it.

Where things live: the contracts are declared by package, vLLM's in contracts_vllm.py and speculators' and
transformers' in contracts_training.py, each beside its behaviour probes; contract_checks.py holds the vocabulary
(Contract, AuditResult, the statuses, the check builders, how a symbol is found). This module joins them in
`CONTRACTS` and audits them.
"""

from __future__ import annotations

import importlib.util
from typing import Any

# The vocabulary, and the contracts by package; every name stays importable from here.
from eagle3lib.compat.contract_checks import ERROR as ERROR
from eagle3lib.compat.contract_checks import MISMATCH as MISMATCH
from eagle3lib.compat.contract_checks import NOT_INSTALLED as NOT_INSTALLED
from eagle3lib.compat.contract_checks import OK as OK
from eagle3lib.compat.contract_checks import REPAIRED as REPAIRED
from eagle3lib.compat.contract_checks import AuditResult as AuditResult
from eagle3lib.compat.contract_checks import Contract as Contract
from eagle3lib.compat.contract_checks import ContractMismatch as ContractMismatch
from eagle3lib.compat.contract_checks import _resolve, _resolve_source
from eagle3lib.compat.contract_checks import both as both
from eagle3lib.compat.contract_checks import exists as exists
from eagle3lib.compat.contract_checks import has_params as has_params
from eagle3lib.compat.contract_checks import is_subclass_of as is_subclass_of
from eagle3lib.compat.contract_checks import package_installed as package_installed
from eagle3lib.compat.contract_checks import params_start as params_start
from eagle3lib.compat.contract_checks import require as require
from eagle3lib.compat.contract_checks import source_class as source_class
from eagle3lib.compat.contracts_training import SPECULATORS_CONTRACTS, TRANSFORMERS_CONTRACTS
from eagle3lib.compat.contracts_vllm import VLLM_CONTRACTS

# Every contract, in the audit table's order: vLLM, speculators, transformers.
CONTRACTS: list[Contract] = [*VLLM_CONTRACTS, *SPECULATORS_CONTRACTS, *TRANSFORMERS_CONTRACTS]


def _check_one(c: Contract) -> tuple[str, str]:
    top = c.symbol.partition(":")[0].split(".")[0]
    if not package_installed(c.package) or not package_installed(top):
        return NOT_INSTALLED, f"not installed: stages {', '.join(c.stages)} need it"
    try:
        if c.kind == "source":
            target = _resolve_source(c.symbol)
        elif c.kind == "source-module":
            if importlib.util.find_spec(c.symbol) is None:
                raise ContractMismatch(f"module {c.symbol} does not exist")
            target = None
        else:
            target = _resolve(c.symbol)
        note = c.check(target)
        return OK, note or ""
    except ContractMismatch as e:
        return MISMATCH, str(e)
    except ModuleNotFoundError as e:
        return NOT_INSTALLED, f"not installed ({e.name} missing): stages {', '.join(c.stages)} need it"
    except Exception as e:  # noqa: BLE001 - one broken contract must not hide the others
        return ERROR, f"{type(e).__name__}: {e}"[:300]


def audit(contracts: list[Contract] | None = None, patches: dict[str, Any] | None = None) -> list[AuditResult]:
    """Check every contract and return every result; never stops at the first failure.

    A mismatch that an APPLIED patch repairs, but which the check cannot observe (e.g. the patch wraps an
    __init__), is reported as 'repaired'. Probes that observe behaviour (rotary, connector) report 'ok' once fixed.
    """
    if patches is None:
        from eagle3lib.compat import PATCHES

        patches = PATCHES
    results = []
    for c in CONTRACTS if contracts is None else contracts:
        status, detail = _check_one(c)
        repairers = [p for p in patches.values() if p.repairs in (c.name, *c.aliases)]
        if status == MISMATCH and any(p.applied for p in repairers):
            status, detail = REPAIRED, f"{detail} — repaired by {', '.join(p.name for p in repairers if p.applied)}"
        results.append(AuditResult(c.name, c.package, c.symbol, c.kind, c.expect, status, detail, c.stages,
                                   c.needs, [p.name for p in repairers]))
    return results


def check_contract(name: str) -> tuple[str, str] | None:
    """(status, detail) of the one contract called `name` (or aliased so); None if no such contract."""
    for c in CONTRACTS:
        if name == c.name or name in c.aliases:
            return _check_one(c)
    return None
