"""eagle3-workbook: train EAGLE-3 speculative-decoding drafts stage by stage (notebooks 00-06 over this package)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("eagle3-workbook")
except PackageNotFoundError:  # run from a source tree that is not installed (e.g. carried to a GPU machine)
    __version__ = "0+source"
