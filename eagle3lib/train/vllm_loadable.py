"""What vLLM's loader makes of a stage-05 checkpoint (any drafter), read with vLLM's own speculators config parser.

Why a check of its own: a checkpoint speculators reloads can still fail in vLLM (a config field its parser does not
pass through, an fc sized for another number of aux layers); `check_vllm_config` names each such problem in notebook 05,
without starting vLLM, and `pin_aux_layer_count` writes the one field the workbook's drafts need.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3lib.common import atomic


def vllm_fc_aux_count(hf: dict[str, Any]) -> int:
    """How many aux layers vLLM's Eagle3 llama draft sizes its fc for (llama_eagle3.py, 0.26 to 0.32): the config's
    num_aux_hidden_states, else eagle_config's layer ids, else 3. The top-level eagle_aux_hidden_state_layer_ids that
    vLLM's own speculators parser writes is NOT read there, so a draft on 1, 2 or 4+ layers fails to load without
    num_aux_hidden_states ("Tried to load weights of size [576, 576] to a parameter of size [576, 1728]")."""
    if hf.get("num_aux_hidden_states"):
        return int(hf["num_aux_hidden_states"])
    return len((hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []) or 3


def pin_aux_layer_count(ckpt: str | Path) -> None:
    """Write num_aux_hidden_states into the checkpoint's transformer_layer_config (which vLLM's parser passes
    through to the draft's config) so vLLM sizes the fc for the layers the draft was trained on."""
    path = Path(ckpt) / "config.json"
    cfg = json.loads(path.read_text())
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux:
        cfg.setdefault("transformer_layer_config", {})["num_aux_hidden_states"] = len(aux)
        atomic.write_json(path, cfg)


def vllm_view(ckpt: str | Path) -> dict[str, Any]:
    """What vLLM's eagle3 loader makes of a checkpoint's config.json, using vLLM's own speculators config parser."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    config_dict = json.loads((Path(ckpt) / "config.json").read_text())
    hf = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(config_dict)))
    spec = SpeculatorsConfig.extract_vllm_speculative_config(config_dict)
    return {"hf": hf, "speculative": spec, "verifier": config_dict["speculators_config"]["verifier"]["name_or_path"]}


# what vLLM's speculators parser must make of each drafter's checkpoint: its model classes, and its
# `--speculative-config` method (vllm/transformers_utils/configs/speculators/: algos.py and base.py)
VLLM_ARCHITECTURES = {"eagle3": {"Eagle3LlamaForCausalLM", "Eagle3Qwen3ForCausalLM"},
                      "peagle": {"PeagleLlamaForCausalLM", "PeagleQwen3ForCausalLM"},
                      "dflash": {"DFlashDraftModel"}}


def check_vllm_config(ckpt: str | Path, *, hidden_size: int, aux_layer_ids: list[int], draft_vocab_size: int,
                      draft_tokens: int, target_vocab_size: int) -> list[str]:
    """Problems vLLM's loader would hit with this checkpoint of any drafter (empty = loadable as far as config and
    tensor names go): architecture, sizes, aux layer ids (DFlash's as vLLM re-indexes them), mask token, speculative
    method and tokens per step (`draft_tokens`), the verifier path, and the weight names."""
    from safetensors import safe_open

    from eagle3lib.common.drafters import algorithm_of, checkpoint_config, speculative_config

    algorithm = algorithm_of(ckpt)
    problems: list[str] = []
    view = vllm_view(ckpt)
    hf, spec = view["hf"], view["speculative"]
    want: dict[str, Any] = {"draft_vocab_size": draft_vocab_size, "hidden_size": hidden_size,
                            "eagle_aux_hidden_state_layer_ids": aux_layer_ids, "vocab_size": target_vocab_size}
    mask = checkpoint_config(ckpt).get("mask_token_id")
    if algorithm == "peagle":
        want["pard_token"] = mask
    if algorithm == "dflash":  # vLLM's DFlash counts layers from the other end of a decoder layer (algos.py)
        want["dflash_config.target_layer_ids"] = [i - 1 for i in aux_layer_ids]
        want["dflash_config.mask_token_id"] = mask
    for key, value in want.items():
        head, _, sub = key.partition(".")
        got = (hf.get(head) or {}).get(sub) if sub else hf.get(head)
        if got != value:
            problems.append(f"{key}: vLLM reads {got!r}, expected {value!r}")
    if not set(hf.get("architectures") or []) & VLLM_ARCHITECTURES.get(algorithm, set()):
        problems.append(f"architectures: vLLM reads {hf.get('architectures')}, expected one of "
                        f"{sorted(VLLM_ARCHITECTURES.get(algorithm, set()))} for {algorithm}")
    if algorithm != "dflash" and vllm_fc_aux_count(hf) != len(aux_layer_ids):
        problems.append(f"vLLM sizes the draft's fc for {vllm_fc_aux_count(hf)} aux layers, the draft has "
                        f"{len(aux_layer_ids)} (num_aux_hidden_states missing: see pin_aux_layer_count)")
    if hf.get("target_hidden_size", hidden_size) != hidden_size:
        problems.append(f"target_hidden_size {hf.get('target_hidden_size')} != {hidden_size}")
    served = speculative_config(algorithm, ckpt, draft_tokens)  # what stage 06 starts the drafter's server with

    def drafting(s: dict[str, Any]) -> tuple[Any, Any, bool]:
        return s.get("method"), s.get("num_speculative_tokens"), bool(s.get("parallel_drafting"))

    if drafting(spec) != drafting(served):
        problems.append(f"speculative config {spec}, expected {served['method']} with {draft_tokens} tokens"
                        + (" and parallel_drafting" if served.get("parallel_drafting") else ""))
    if not view["verifier"] or not Path(view["verifier"]).is_dir():
        problems.append(f"verifier path {view['verifier']!r} is not a folder here")
    with safe_open(str(Path(ckpt) / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    n_aux = len(aux_layer_ids)
    need = {"fc.weight": (hidden_size, n_aux * hidden_size), "norm.weight": (hidden_size,)}
    if draft_vocab_size != target_vocab_size:
        need |= {"d2t": (draft_vocab_size,), "t2d": (target_vocab_size,), "lm_head.weight": (draft_vocab_size, hidden_size)}
    elif algorithm != "dflash":  # a full-vocabulary DFlash draft takes the verifier's lm_head (not saved)
        need["lm_head.weight"] = (draft_vocab_size, hidden_size)
    if algorithm == "peagle":
        need["mask_hidden"] = (1, 1, n_aux * hidden_size)
    for key, shape in need.items():
        if shapes.get(key) != shape:
            problems.append(f"tensor {key}: {shapes.get(key)} in the checkpoint, vLLM needs {shape}")
    if not any(k.startswith("layers.0.") for k in shapes):
        problems.append("no layers.0.* tensors (the draft decoder layer)")
    return problems
