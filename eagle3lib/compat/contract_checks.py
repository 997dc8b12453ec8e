"""The contract audit's vocabulary: what a contract is, the statuses of its result, the small check builders the
declared contracts are made of, and how a contract's symbol is found (imported, or parsed without importing).

The contracts themselves are declared by package in contracts_vllm.py and contracts_training.py; contracts.py
audits them.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Status words used in results and tables.
OK, MISMATCH, REPAIRED, NOT_INSTALLED, ERROR = "ok", "mismatch", "repaired", "not installed", "error"


class ContractMismatch(Exception):
    """Raised by a check: the symbol exists but does not behave or look as the workbook expects."""


@dataclass(frozen=True)
class Contract:
    """One thing the workbook relies on. `check(obj)` raises ContractMismatch (or returns a note) for the resolved
    `symbol` ('module:Qualified.name'; for kind 'source' the module is parsed instead of imported)."""

    name: str
    package: str  # import name of the top-level package ("vllm", "speculators", "transformers")
    symbol: str
    expect: str  # one line: what is expected
    check: Callable[[Any], str | None]
    stages: tuple[str, ...]
    needs: tuple[str, ...]  # configuration tags that rely on it (see required_tags)
    kind: str = "signature"
    aliases: tuple[str, ...] = ()  # other names a patch's `repairs` may use for this contract


@dataclass
class AuditResult:
    name: str
    package: str
    symbol: str
    kind: str
    expect: str
    status: str
    detail: str
    stages: tuple[str, ...]
    needs: tuple[str, ...]
    repaired_by: list[str] = field(default_factory=list)



# ---------------------------------------------------------------------------------------------------------------
# Small check builders
# ---------------------------------------------------------------------------------------------------------------

def _positional(fn: Any) -> list[str]:
    sig = inspect.signature(fn)
    return [p.name for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("self", "cls")]


def params_start(*names: str) -> Callable[[Any], str | None]:
    """The first positional parameters (after self) are exactly `names`, in order."""

    def check(fn: Any) -> str | None:
        got = _positional(fn)
        if got[: len(names)] != list(names):
            raise ContractMismatch(f"positional parameters are ({', '.join(got)}), expected to start with "
                                   f"({', '.join(names)})")
        return f"({', '.join(got)})"

    return check


def has_params(*names: str, defaults: dict[str, Any] | None = None) -> Callable[[Any], str | None]:
    """Each of `names` is a parameter (any kind); `defaults` also pins their default values."""

    def check(fn: Any) -> str | None:
        params = inspect.signature(fn).parameters
        missing = [n for n in names if n not in params]
        if missing:
            raise ContractMismatch(f"no parameter {', '.join(missing)} (has {', '.join(params)})")
        for n, want in (defaults or {}).items():
            got = params[n].default
            if got is inspect.Parameter.empty or got != want:
                raise ContractMismatch(f"parameter {n} defaults to {got!r}, expected {want!r}")
        return None

    return check


def both(*checks: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    def check(obj: Any) -> str | None:
        notes = [c(obj) for c in checks]
        return "; ".join(n for n in notes if n) or None

    return check


def exists(obj: Any) -> str | None:
    return None


def require(pred: Callable[[Any], bool], msg: str | Callable[[Any], str]) -> Callable[[Any], str | None]:
    """A check from a predicate: mismatch (with `msg`) when pred(obj) is false."""

    def check(obj: Any) -> str | None:
        if not pred(obj):
            raise ContractMismatch(msg(obj) if callable(msg) else msg)
        return None

    return check


def _fields(cls: Any) -> set[str]:
    return set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "model_fields", {}))


def is_subclass_of(module: str, qualname: str) -> Callable[[Any], str | None]:
    def check(cls: Any) -> str | None:
        base = _resolve(f"{module}:{qualname}")
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ContractMismatch(f"{getattr(cls, '__name__', cls)} is not a subclass of {qualname}")
        return None

    return check


def source_class(methods: tuple[str, ...] = (), assigns: tuple[str, ...] = (),
                 bases: tuple[str, ...] = ()) -> Callable[[Any], str | None]:
    """For kind 'source': the parsed class defines `methods`, assigns `self.<assigns>` somewhere, lists `bases`."""

    def check(cls_node: ast.ClassDef) -> str | None:
        defined = {n.name for n in cls_node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        assigned = {t.attr for n in ast.walk(cls_node) if isinstance(n, ast.Assign | ast.AnnAssign)
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
        base_names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls_node.bases}
        problems = [f"no method {m}" for m in methods if m not in defined]
        problems += [f"never assigns self.{a}" for a in assigns if a not in assigned]
        problems += [f"does not list {b} among its bases" for b in bases if b not in base_names]
        if problems:
            raise ContractMismatch("; ".join(problems))
        return None

    return check


# ---------------------------------------------------------------------------------------------------------------
# Symbol resolution
# ---------------------------------------------------------------------------------------------------------------

def _resolve(symbol: str) -> Any:
    module_name, _, qual = symbol.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, qual.split(".")):
        if not hasattr(obj, part):
            raise ContractMismatch(f"{module_name} has no {qual} (missing {part!r})")
        obj = getattr(obj, part)
    return obj


def _resolve_source(symbol: str) -> ast.ClassDef:
    """Find a class in a module's source without importing the module (its imports may fail here)."""
    module_name, _, qual = symbol.partition(":")
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise ContractMismatch(f"module {module_name} does not exist")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == qual:
            return node
    raise ContractMismatch(f"{module_name} defines no class {qual}")


def package_installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False
