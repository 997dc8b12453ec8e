"""The speculators and transformers contracts: speculators' draft model, vocabulary mapping, data, FP8 shards,
Trainer (also on a machine without an accelerator) and CLI flags (stages 04-06); transformers' GGUF loading, the
logits_to_keep forward and the hidden-states convention (stages 00 and 02).

contracts.py audits these with the vLLM contracts (contracts_vllm.py).
"""

from __future__ import annotations

from typing import Any

from eagle3lib.compat.contract_checks import (
    Contract,
    ContractMismatch,
    both,
    exists,
    has_params,
    params_start,
    require,
)

_S = "speculators"
_T = "transformers"


# ---------------------------------------------------------------------------------------------------------------
# Behaviour probes (milliseconds each once the package is imported)
# ---------------------------------------------------------------------------------------------------------------

def probe_trainer_cpu(cls: Any) -> str | None:
    """Without an accelerator, speculators' Trainer must still work on 'cpu'. Observed, not assumed:
    (1) what Trainer.__init__ assigns to device_type without an accelerator ('cuda', which silently turns autocast
    off) must read back as 'cpu'; (2) the trainer module's local rank (where setup_model moves the model) must be a
    device that exists here; (3) torch.accelerator.synchronize (called every logged step) must not raise."""
    import torch

    acc = torch.accelerator.current_accelerator()
    if acc is not None:
        return f"accelerator {acc.type}"
    import speculators.train.trainer as trainer_mod

    problems = []
    t = cls.__new__(cls)
    try:
        t.device_type = "cuda"  # exactly what __init__ does when no accelerator exists
        if t.device_type != "cpu":
            problems.append(f"device_type resolves to {t.device_type!r} (autocast on 'cuda' is silently off)")
    except Exception as e:  # noqa: BLE001
        problems.append(f"device_type: {type(e).__name__}: {e}")
    try:
        torch.empty(1).to(trainer_mod.get_local_rank())
    except Exception as e:  # noqa: BLE001
        problems.append(f"setup_model's device {trainer_mod.get_local_rank()!r} does not exist here "
                        f"({type(e).__name__})")
    try:
        torch.accelerator.synchronize()
    except Exception as e:  # noqa: BLE001
        problems.append(f"torch.accelerator.synchronize raises {type(e).__name__}")
    if problems:
        raise ContractMismatch("no accelerator here: " + "; ".join(problems))
    return "no accelerator; Trainer resolves to cpu"


def probe_train_config_fields(cls: Any) -> str | None:
    flat = cls().flatten()
    wanted = ("verifier_name_or_path", "data_path", "loss_implementation", "draft_attn_impl", "mask_token_id",
              "num_workers", "save_path", "lr")
    missing = [k for k in wanted if k not in flat]
    if missing:
        raise ContractMismatch(f"TrainConfig has no flag {', '.join(missing)}")
    return None


def probe_vocab_mapping(fn: Any) -> str | None:
    """d2t is an offset (target = i + d2t[i]) and t2d a boolean mask, as stage 04 writes them."""
    import torch

    d2t, t2d = fn({5: 10, 2: 7, 9: 1}, 3, 12)
    target_ids = torch.arange(3) + d2t
    if t2d.dtype != torch.bool or sorted(target_ids.tolist()) != [2, 5, 9] or int(t2d.sum()) != 3:
        raise ContractMismatch(f"unexpected mapping: d2t={d2t.tolist()}, t2d={t2d.tolist()}")
    return "d2t offsets, t2d bool mask"


def probe_fp8_transfer(cls: Any) -> str | None:
    """An FP8 shard the workbook writes (extract.fp8_shards) reads back through speculators' FP8Transfer exactly as
    through `shards.read_shard`, and is half the size of the bf16 one."""
    import tempfile
    from pathlib import Path

    import torch

    from eagle3lib.common import shards

    states = torch.randn(5, 4, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([1., 4., 16., 64.])[:, None]
    ids = torch.arange(5)
    with tempfile.TemporaryDirectory() as d:
        shards.shard_dir(Path(d)).mkdir()
        for i, fp8 in enumerate((False, True)):
            shards.write_shard(Path(d), i, ids, states.bfloat16(), ids, shards.ShardSpec(4, 64, torch.bfloat16, fp8))
        theirs = cls(shards.shard_dir(Path(d)), dequantize_dtype=torch.bfloat16).get_cached(1)
        ours = shards.read_shard(shards.shard_path(Path(d), 1), torch.bfloat16)
        sizes = [shards.shard_path(Path(d), i).stat().st_size for i in (0, 1)]
    if set(theirs) != {"token_ids", "hidden_states"} or not torch.equal(theirs["hidden_states"], ours["hidden_states"]):
        raise ContractMismatch(f"FP8Transfer read {sorted(theirs)} that differ from the workbook's dequantized shard")
    err = ((ours["hidden_states"].float() - states).abs() / states.abs().amax(dim=(1, 2), keepdim=True)).max()
    if err > 2 ** -4:
        raise ContractMismatch(f"FP8 round trip error {float(err):.3g} of the token's max (e4m3: at most 1/16)")
    return f"FP8 round trip within {float(err):.3g} of each token's max; {sizes[1]} vs {sizes[0]} bytes in bf16"


def probe_transformers_hidden_states(cls: Any) -> str | None:
    """transformers' hidden_states[k] is the stream entering layer k and the last entry is POST-norm; the pre-norm
    final state comes from a forward hook on the last decoder layer (what stage 02's transformers backend does)."""
    import torch
    from transformers import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    model = cls(cfg).eval()
    got: dict[str, torch.Tensor] = {}
    h = model.layers[-1].register_forward_hook(
        lambda m, a, out: got.__setitem__("pre", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.arange(6)[None], output_hidden_states=True)
    finally:
        h.remove()
    hs = out.hidden_states
    if len(hs) != 3:
        raise ContractMismatch(f"{len(hs)} hidden_states for 2 layers, expected 3 (embeddings + one per layer)")
    if not torch.allclose(model.norm(got["pre"]), hs[-1], atol=1e-5):
        raise ContractMismatch("hidden_states[-1] is not norm(last layer output): the final-state convention moved")
    return "hidden_states[-1] post-norm; hook on layers[-1] gives pre-norm"


# ---------------------------------------------------------------------------------------------------------------
# The declared contracts
# ---------------------------------------------------------------------------------------------------------------

SPECULATORS_CONTRACTS: list[Contract] = [
    # --- speculators: model, vocab, data, trainer, CLI -----------------------------------------------------------
    Contract("speculators.Eagle3DraftModel.from_training_args", _S,
             "speculators.models.eagle3:Eagle3DraftModel.from_training_args",
             "from_training_args(verifier_config, t2d=None, d2t=None, **kwargs)",
             both(params_start("verifier_config", "t2d", "d2t"), has_params("kwargs")), ("05",), ("speculators",)),
    Contract("speculators.Eagle3DraftModel.forward", _S, "speculators.models.eagle3:Eagle3DraftModel.forward",
             "forward(hidden_states, input_ids, document_ids, loss_mask, position_ids, verifier_last_hidden_states, "
             "ttt_steps, ...) returning (draft_tokens, loss, metrics) when verifier states are given",
             both(params_start("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids",
                               "verifier_last_hidden_states"), has_params("ttt_steps")), ("05", "06"),
             ("speculators",)),
    Contract("speculators.build_vocab_mappings_from_distribution", _S,
             "speculators.train.vocab_mapping:build_vocab_mappings_from_distribution",
             "build_vocab_mappings_from_distribution(token_freq_dict, draft_vocab_size, target_vocab_size) → "
             "(d2t offsets, t2d bool mask)", probe_vocab_mapping, ("04",), ("speculators",), kind="probe"),
    Contract("speculators.ArrowDataset", _S, "speculators.train.data:ArrowDataset.__init__",
             "ArrowDataset(max_len, datapath, transfer, ..., train_ratio, split, hidden_states_dtype)",
             both(params_start("max_len", "datapath"), has_params("transfer", "train_ratio", "split",
                                                                   "hidden_states_dtype")),
             ("05",), ("speculators",)),
    Contract("speculators.MultipackDistributedBatchSamplerV2._generate_batches", _S,
             "speculators.train.distributed_batch_sampler:MultipackDistributedBatchSamplerV2._generate_batches",
             "_generate_batches(epoch) → that epoch's batches (spool mode's sampler reads every batch of a pass "
             "ahead and checks the budget against them)", params_start("epoch"), ("05",), ("speculators-spool",)),
    Contract("speculators.FP8Transfer", _S, "hs_connectors.transfer:FP8Transfer",
             "FP8Transfer(hidden_states_path, dequantize_dtype).get_cached(i): speculators' FP8 shards (e4m3, one "
             "float32 scale per token under 'hidden_states_scales') back in the training dtype",
             probe_fp8_transfer, ("02", "05"), ("speculators",), kind="probe"),
    Contract("speculators.Trainer.__init__", _S, "speculators.train.trainer:Trainer.__init__",
             "Trainer(model, config, train_loader, val_loader=None)",
             params_start("model", "config", "train_loader", "val_loader"), ("05",), ("speculators",)),
    Contract("speculators.Trainer.cpu_device", _S, "speculators.train.trainer:Trainer",
             "the Trainer runs on a machine without an accelerator (device 'cpu', autocast on 'cpu')",
             probe_trainer_cpu, ("05",), ("speculators-cpu",), kind="probe",
             aliases=("speculators.train.Trainer runs on CPU",)),
    Contract("speculators.train_cli", _S, "speculators.train.config:TrainConfig",
             "`speculators train` flags: loss_implementation, draft_attn_impl, mask_token_id, num_workers, ...",
             probe_train_config_fields, ("05",), ("speculators",), kind="probe"),
]

TRANSFORMERS_CONTRACTS: list[Contract] = [
    # --- transformers ------------------------------------------------------------------------------------------
    Contract("transformers.gguf.load_gguf_checkpoint", _T,
             "transformers.modeling_gguf_pytorch_utils:load_gguf_checkpoint",
             "GGUF loading: load_gguf_checkpoint(gguf_checkpoint_path, return_tensors, ...) (from_pretrained(gguf_file=))",
             params_start("gguf_checkpoint_path", "return_tensors"), ("00", "02"), ("transformers-gguf",)),
    Contract("transformers.gguf.llama_supported", _T,
             "transformers.modeling_gguf_pytorch_utils:GGUF_SUPPORTED_ARCHITECTURES",
             "GGUF architecture 'llama' is supported (the embedded SmolLM2 target)",
             require(lambda archs: "llama" in archs, lambda archs: f"supported: {archs}"), ("00", "02"), ("gguf:llama",), kind="attribute"),
    Contract("transformers.gguf.qwen2_supported", _T,
             "transformers.modeling_gguf_pytorch_utils:GGUF_SUPPORTED_ARCHITECTURES",
             "GGUF architecture 'qwen2' is supported (the embedded Qwen2.5-Coder targets)",
             require(lambda archs: "qwen2" in archs, lambda archs: f"supported: {archs}"), ("00", "02"), ("gguf:qwen2",), kind="attribute"),
    Contract("transformers.gguf.package", "gguf", "gguf:GGUFReader",
             "the gguf package (transformers reads GGUF files with it)", exists, ("00", "02"),
             ("transformers-gguf",), kind="attribute"),
    Contract("transformers.CausalLM.logits_to_keep", _T, "transformers:LlamaForCausalLM.forward",
             "forward(logits_to_keep=...) computes logits at chosen positions only (the capture probe's reference)",
             has_params("logits_to_keep"), ("02",), ("transformers",)),
    Contract("transformers.llama.hidden_states_convention", _T, "transformers:LlamaModel",
             "hidden_states[k] enters layer k; hidden_states[-1] is POST-norm; a hook on layers[-1] gives pre-norm",
             probe_transformers_hidden_states, ("02",), ("transformers",), kind="probe"),
]
