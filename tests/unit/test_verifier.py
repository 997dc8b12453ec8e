"""Stage 04: verifier tensors read from tiny checkpoints written here (single file, sharded, tied, prefixed,
bf16/fp16, quantized other weights, quantized lm_head, missing tensors), the draft vocabulary, and the notebook.

The reference for "the right tensor" is what transformers loads from the same checkpoint (or, for checkpoints
transformers cannot load as written, the tensors the test itself wrote)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_tiny_llama
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3lib import verifier
from eagle3lib.common import checkpoint_head
from eagle3lib.common.errors import WorkbookError
from eagle3lib.verifier import draft_vocab, weights


def transformers_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    return {"embed": model.get_input_embeddings().weight.detach().clone(),
            "lm_head": model.get_output_embeddings().weight.detach().clone(),
            "norm": model.model.norm.weight.detach().clone()}


def assert_same(vt: checkpoint_head.VerifierTensors, ref: dict[str, torch.Tensor]) -> None:
    for name in ("embed", "lm_head", "norm"):
        got = getattr(vt, name)
        assert got.dtype == ref[name].dtype, name
        assert torch.equal(got, ref[name]), name


def save_tiny(out: Path, dtype: torch.dtype = torch.float32, tie: bool = False, max_shard_size: str | None = None,
              vocab: int = 512) -> Path:
    """A tiny random Llama in the given dtype, single file or sharded."""
    from transformers import AutoModelForCausalLM

    src = build_tiny_llama(out.parent / f"{out.name}-src", tie=tie, vocab=vocab)
    if dtype == torch.float32 and max_shard_size is None:
        return src
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out


def rewrite_checkpoint(src: Path, out: Path, rename, extra: dict[str, torch.Tensor] | None = None,
                       drop=lambda k: False, shards: int = 1, config_update: dict | None = None) -> Path:
    """Copy a single-file checkpoint with renamed / dropped / extra tensors, as one file or `shards` files plus an
    index (the way a wrapper or a quantizer lays its checkpoint out)."""
    out.mkdir(parents=True)
    sd = {rename(k): v for k, v in load_file(str(src / "model.safetensors")).items() if not drop(k)}
    sd.update(extra or {})
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config_update or {})
    (out / "config.json").write_text(json.dumps(cfg))
    keys = sorted(sd)
    if shards == 1:
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k].contiguous() for k in keys[i::shards]}
        save_file(part, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("untied") / "m", tie=False)


# ------------------------------------------------------------------------------------------------ layouts


def test_single_file_equals_transformers(tiny_untied):
    vt = checkpoint_head.read_verifier_tensors(tiny_untied)
    assert vt.files_opened == ["model.safetensors"]
    assert not vt.tied
    assert (vt.keys.embed, vt.keys.lm_head, vt.keys.norm) == ("model.embed_tokens.weight", "lm_head.weight",
                                                              "model.norm.weight")
    assert_same(vt, transformers_tensors(tiny_untied))


def test_sharded_opens_only_the_shards_that_hold_them(tmp_path, monkeypatch):
    model_dir = save_tiny(tmp_path / "sharded", max_shard_size="40KB")
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    all_shards = set(weight_map.values())
    needed = {weight_map[k] for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")}
    assert len(all_shards) >= 4 and len(needed) < len(all_shards)

    opened: list[str] = []
    real_safe_open = checkpoint_head.safe_open

    def recording_safe_open(path, *args, **kwargs):  # records, then opens for real
        opened.append(Path(path).name)
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_head, "safe_open", recording_safe_open)
    vt = checkpoint_head.read_verifier_tensors(model_dir)
    monkeypatch.undo()
    assert set(opened) == needed == set(vt.files_opened)
    assert_same(vt, transformers_tensors(model_dir))


def test_tied_uses_the_embedding(tmp_path):
    model_dir = build_tiny_llama(tmp_path / "tied", tie=True)
    assert "lm_head.weight" not in load_file(str(model_dir / "model.safetensors"))
    vt = checkpoint_head.read_verifier_tensors(model_dir)
    assert vt.tied and vt.keys.lm_head is None
    assert_same(vt, transformers_tensors(model_dir))
    vt2, info = weights.extract_verifier(model_dir, tmp_path / "verifier")
    assert info["tied"] and "lm_head.weight" not in load_file(str(tmp_path / "verifier/model.safetensors"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_are_kept(tmp_path, dtype):
    model_dir = save_tiny(tmp_path / "half", dtype=dtype)
    vt = checkpoint_head.read_verifier_tensors(model_dir)
    assert vt.embed.dtype == dtype
    assert_same(vt, transformers_tensors(model_dir))


@pytest.mark.parametrize("layout", ["language_model.model.", "model.language_model."])
def test_prefixed_names_with_decoys(tiny_untied, tmp_path, layout):
    """Wrapper prefixes (Llava-style language_model.model.*, transformers-5 VLM model.language_model.*), with a
    DeepSeek-style MTP layer and a vision tower that also have embeddings/norms/heads: the top-level ones win."""
    original = load_file(str(tiny_untied / "model.safetensors"))
    head = "language_model.lm_head.weight" if layout.startswith("language_model") else "lm_head.weight"

    def rename(k: str) -> str:
        return head if k == "lm_head.weight" else layout + k.removeprefix("model.")

    decoys = {f"{layout}layers.6.embed_tokens.weight": torch.zeros(512, 64),
              f"{layout}layers.6.shared_head.head.weight": torch.zeros(512, 64),
              f"{layout}layers.6.norm.weight": torch.zeros(64),
              "vision_tower.embeddings.patch_embedding.weight": torch.zeros(8, 3),
              "vision_tower.post_layernorm.weight": torch.zeros(8), "vision_tower.norm.weight": torch.zeros(8)}
    model_dir = rewrite_checkpoint(tiny_untied, tmp_path / "prefixed", rename, decoys, shards=3)
    vt = checkpoint_head.read_verifier_tensors(model_dir)
    assert vt.keys.embed == f"{layout}embed_tokens.weight"
    assert vt.keys.norm == f"{layout}norm.weight"
    assert vt.keys.lm_head == head
    assert torch.equal(vt.embed, original["model.embed_tokens.weight"])
    assert torch.equal(vt.lm_head, original["lm_head.weight"])
    assert torch.equal(vt.norm, original["model.norm.weight"])


def quantize_like_compressed_tensors(sd: dict[str, torch.Tensor], which) -> dict[str, torch.Tensor]:
    """Replace `which` Linear weights by INT4 compressed-tensors keys (weight_packed int32, weight_scale bf16,
    weight_shape), the way Kimi-K2.5's experts are stored."""
    out = {}
    for k, v in sd.items():
        if which(k):
            base = k.removesuffix(".weight")
            out[f"{base}.weight_packed"] = torch.randint(-2**31, 2**31 - 1, (v.shape[0], v.shape[1] // 8),
                                                         dtype=torch.int32)
            out[f"{base}.weight_scale"] = torch.ones(v.shape[0], v.shape[1] // 32, dtype=torch.bfloat16)
            out[f"{base}.weight_shape"] = torch.tensor(list(v.shape), dtype=torch.int32)
        else:
            out[k] = v
    return out


def test_quantized_other_weights_are_not_a_problem(tiny_untied, tmp_path):
    original = load_file(str(tiny_untied / "model.safetensors"))
    bf16 = {k: v.to(torch.bfloat16) for k, v in original.items()}
    sd = quantize_like_compressed_tensors(bf16, lambda k: "proj.weight" in k)
    src = tmp_path / "src"
    src.mkdir()
    save_file(sd, str(src / "model.safetensors"))
    (src / "config.json").write_text((tiny_untied / "config.json").read_text())
    quant_cfg = {"quantization_config": {"quant_method": "compressed-tensors", "ignore": ["lm_head"]}}
    model_dir = rewrite_checkpoint(src, tmp_path / "int4", lambda k: k, shards=4, config_update=quant_cfg)
    vt, info = weights.extract_verifier(model_dir, tmp_path / "verifier")
    assert torch.equal(vt.embed, bf16["model.embed_tokens.weight"]) and vt.embed.dtype == torch.bfloat16
    assert torch.equal(vt.lm_head, bf16["lm_head.weight"])
    assert torch.equal(vt.norm, bf16["model.norm.weight"])
    assert len(vt.files_opened) < 4
    written = json.loads((tmp_path / "verifier/config.json").read_text())
    assert "quantization_config" not in written


def test_quantized_lm_head_is_refused(tiny_untied, tmp_path):
    original = load_file(str(tiny_untied / "model.safetensors"))
    sd = quantize_like_compressed_tensors(original, lambda k: k == "lm_head.weight" or "proj.weight" in k)
    src = tmp_path / "src"
    src.mkdir()
    save_file(sd, str(src / "model.safetensors"))
    (src / "config.json").write_text((tiny_untied / "config.json").read_text())
    with pytest.raises(WorkbookError, match=r"lm_head .* is quantized \(lm_head.weight_packed"):
        checkpoint_head.read_verifier_tensors(src)
    fp8 = rewrite_checkpoint(tiny_untied, tmp_path / "fp8", lambda k: k, drop=lambda k: k == "lm_head.weight",
                             extra={"lm_head.weight": original["lm_head.weight"].to(torch.float8_e4m3fn)})
    with pytest.raises(WorkbookError, match=r"lm_head.weight .* stored as F8_E4M3, i.e. quantized"):
        checkpoint_head.read_verifier_tensors(fp8)


def test_missing_tensors_name_the_keys_found(tiny_untied, tmp_path):
    no_norm = rewrite_checkpoint(tiny_untied, tmp_path / "no_norm", lambda k: k, drop=lambda k: k == "model.norm.weight")
    with pytest.raises(WorkbookError, match=r"no final norm .*keys found: (?=.*model\.embed_tokens\.weight)(?=.*lm_head\.weight)"):
        checkpoint_head.read_verifier_tensors(no_norm)
    no_embed = rewrite_checkpoint(tiny_untied, tmp_path / "no_embed", lambda k: k,
                                  drop=lambda k: "embed_tokens" in k)
    with pytest.raises(WorkbookError, match=r"no token embedding .*keys found: (?=.*lm_head\.weight)(?=.*model\.norm\.weight)"):
        checkpoint_head.read_verifier_tensors(no_embed)
    # untied config, lm_head gone (a shard not downloaded): not silently tied
    no_head = rewrite_checkpoint(tiny_untied, tmp_path / "no_head", lambda k: k, drop=lambda k: k == "lm_head.weight")
    with pytest.raises(WorkbookError, match=r"no lm_head .*tie_word_embeddings: false; keys found: .*embed_tokens"):
        checkpoint_head.read_verifier_tensors(no_head)
    # a shard named by the index but absent
    sharded = rewrite_checkpoint(tiny_untied, tmp_path / "sharded", lambda k: k, shards=3)
    shard = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    (sharded / shard).unlink()
    with pytest.raises(WorkbookError, match="is missing"):
        checkpoint_head.read_verifier_tensors(sharded)


def test_no_safetensors_at_all(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WorkbookError, match=r"no safetensors weights .*pytorch_model\.bin"):
        checkpoint_head.read_verifier_tensors(tmp_path)


# ------------------------------------------------------------------------------------------------ draft vocabulary


def test_draft_vocab_maps_and_coverage_by_hand():
    vocab = 50
    rng = np.random.default_rng(0)
    tokens = rng.zipf(1.5, 4000) % vocab
    tokens = tokens[tokens != 7]  # one id never seen
    freq = {int(t): int(c) for t, c in zip(*np.unique(tokens, return_counts=True), strict=True)}
    val = rng.zipf(1.5, 1000) % vocab
    val_counts = np.bincount(val, minlength=vocab)
    for k in (1, 10, 49, 50, 500):
        dv = draft_vocab.make_draft_vocab(freq, k, vocab, val_counts)
        kk = min(k, vocab)
        assert dv.k == kk and dv.d2t.dtype == torch.int64 and dv.t2d.dtype == torch.bool
        chosen = (torch.arange(kk) + dv.d2t).numpy()
        assert np.array_equal(np.flatnonzero(dv.t2d.numpy()), chosen)  # target = draft + d2t[draft], sorted
        # the chosen set holds the kk most frequent tokens (no unchosen token is more frequent than a chosen one)
        seen_chosen = [freq.get(int(t), 0) for t in chosen]
        unchosen = [freq.get(t, 0) for t in range(vocab) if t not in set(chosen.tolist())]
        assert not unchosen or min(seen_chosen) >= max(unchosen)
        cov, cov_val = dv.coverage_at_k()
        assert cov == pytest.approx(sum(freq.get(int(t), 0) for t in chosen) / sum(freq.values()))
        assert cov_val == pytest.approx(np.isin(val, chosen).mean())
    assert np.all(np.diff(dv.coverage_train) >= 0) and dv.coverage_train[-1] == pytest.approx(1.0)


def test_token_freq_outside_the_vocab_is_refused(tmp_path):
    torch.save({3: 5, 900: 1}, tmp_path / "token_freq.pt")
    with pytest.raises(WorkbookError, match=r"token ids \[900\] outside the target vocabulary"):
        draft_vocab.load_token_freq(tmp_path / "token_freq.pt", 512)


# ------------------------------------------------------------------------------------------------ the stage


def test_point_checkpoint_at_target(tmp_path, tiny_untied):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"speculators_config": {"verifier": {
        "name_or_path": "/somewhere/verifier", "architectures": []}}}))
    verifier.point_checkpoint_at_target(ckpt, tiny_untied)
    v = json.loads((ckpt / "config.json").read_text())["speculators_config"]["verifier"]
    assert v == {"name_or_path": str(tiny_untied.resolve()), "architectures": ["LlamaForCausalLM"]}


@pytest.mark.slow
def test_notebook_runs_headless_and_speculators_builds_a_draft_from_its_outputs(tiny_run, tmp_path):
    """Notebook 04 through papermill on the tiny run; then speculators builds an EAGLE-3 draft from exactly the
    manifest's outputs: its embedding, lm_head (pruned with t2d) and verifier norm are the tensors transformers
    loads from the target, and the maps load with speculators' own loader. A rerun reuses verifier/."""
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.cli import _load_mappings
    from speculators.utils.loading import load_model_layers
    from transformers import AutoConfig

    from eagle3lib.common.rundir import StageRun
    from eagle3lib.common.stages import get_stage
    from eagle3lib.runner import run_stages

    cfg, rd = tiny_run
    config_file = tmp_path / "tiny.yaml"
    config_file.write_text(cfg.to_yaml())
    run_stages(config_file, stages="04", log_output=False)
    assert (rd.root / "notebooks/04_verifier_weights.ipynb").is_file()
    manifest = rd.read_manifest("04")
    out = {k: rd.root / v for k, v in manifest["outputs"].items()}
    m = manifest["metrics"]
    for key in ("verifier_dir", "t2d", "d2t"):
        assert out[key].exists(), key
    assert m["draft_vocab_size"] == cfg.verifier.draft_vocab_size == 256 and m["tied"] is False
    assert 0 < m["coverage"] <= 1 and m["coverage_val"] is not None
    assert rd.figure_path("04", "coverage").stat().st_size > 1000
    t2d_np, d2t_np = np.load(out["t2d"]), np.load(out["d2t"])
    assert t2d_np.dtype == bool and t2d_np.shape == (512,) and t2d_np.sum() == 256
    assert d2t_np.dtype == np.int64 and d2t_np.shape == (256,)
    with safe_open(str(out["verifier_dir"] / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}

    d2t, t2d, k = _load_mappings(out["d2t"], out["t2d"], m["draft_vocab_size"])
    vdir = str(out["verifier_dir"])
    layer_ids = rd.read_manifest("02")["metrics"]["layer_ids"][:-1]
    draft = Eagle3DraftModel.from_training_args(
        verifier_config=AutoConfig.from_pretrained(vdir), t2d=t2d, d2t=d2t, verifier_name_or_path=vdir,
        draft_vocab_size=k, norm_before_residual=True, ttt_steps=2, target_layer_ids=layer_ids, draft_attn_impl="sdpa")
    model_dir = Path(rd.read_manifest("02")["outputs"]["model_dir"])
    ref = transformers_tensors(model_dir)
    assert torch.equal(draft.embed_tokens.weight.detach(), ref["embed"])
    assert torch.equal(draft.verifier_lm_head.weight.detach(), ref["lm_head"][t2d])
    assert torch.equal(draft.verifier_norm.weight.detach(), ref["norm"])
    # the target folder itself, read by speculators, gives the same tensors (the documented alternative)
    direct = load_model_layers(["embed_tokens.weight", "lm_head.weight", "model.norm.weight"], str(model_dir))
    assert torch.equal(direct["lm_head.weight"], ref["lm_head"])

    again = verifier.run(StageRun(get_stage("04"), cfg, rd), check_speculators=False)
    assert again.metrics["resumed"] is True
    assert all(v == 0.0 for d in again.checks.values() for v in d.values())
    assert torch.equal(torch.from_numpy(np.load(again.outputs["t2d"])), t2d)
