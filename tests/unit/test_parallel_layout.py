"""Every vLLM engine of a run splits the target over GPUs the same way: extract.tensor_parallel_size and
pipeline_parallel_size reach stage 02's engine, stage 06's in-process jobs and its servers
(docs/running.md#big-targets-and-several-gpus)."""

from __future__ import annotations

import json

from eagle3lib.common.config import load_config


def _eagle3_checkpoint(path):
    path.mkdir()
    path.joinpath("config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3",
        "speculators_config": {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]}}))
    return path


def test_stage_06s_jobs_and_servers_split_the_target_as_stage_02s_engine(tmp_path, smollm2_dir):
    from eagle3lib.common.target import load_tokenizer, read_hf_config
    from eagle3lib.evaluate.inputs import EvalInputs
    from eagle3lib.evaluate.methods import vllm_job
    from eagle3lib.evaluate.serve import ServeSweep
    from eagle3lib.extract.backends.adapters import select_adapter
    from eagle3lib.extract.backends.vllm_engine import engine_kwargs, parallel_layout

    base = [f"run.output_root={tmp_path}", f"target.model={smollm2_dir}", "extract.backend=vllm",
            "evaluate.methods=[serve]"]
    cfg = load_config(None, [*base, "extract.tensor_parallel_size=8", "extract.pipeline_parallel_size=2"])
    stage02 = engine_kwargs(cfg, smollm2_dir, select_adapter(read_hf_config(smollm2_dir)))
    layout = parallel_layout(cfg)
    assert layout == {k: stage02[k] for k in ("tensor_parallel_size", "pipeline_parallel_size")} == {
        "tensor_parallel_size": 8, "pipeline_parallel_size": 2}
    assert parallel_layout(load_config(None, base)) == {}  # one GPU: vLLM's own defaults, no flag

    job = vllm_job(smollm2_dir, [[1, 2, 3]], 8, "bfloat16", layout)
    assert {k: job["engine_args"][k] for k in layout} == layout

    tok = load_tokenizer(cfg.target, smollm2_dir)
    inp = EvalInputs(model_dir=smollm2_dir, drafts={"eagle3": _eagle3_checkpoint(tmp_path / "draft")},
                     dataset_dir=tmp_path, eval_prompts=tmp_path / "eval.jsonl", verifier_dir=tmp_path,
                     layer_ids=[2, 15, 27, 30], train_rows=1, val_rows=1, cache_dir=tmp_path / "cache")
    prompts = [tok.encode("Name a prime number.")]

    def server_args(c):
        sweep = ServeSweep(c, inp, tok, prompts, tmp_path / "serve", "bfloat16", {}, {}, None)
        return {p.role: sweep.args[p.id] for p in sweep.plans}

    for role, argv in server_args(cfg).items():  # the draft's server and the target alone's
        assert argv[argv.index("--tensor-parallel-size") + 1] == "8", role
        assert argv[argv.index("--pipeline-parallel-size") + 1] == "2", role
    # evaluate.serve_args' own flag comes later on the command line, and vLLM's parser keeps the last one
    own = load_config(None, [*base, "extract.tensor_parallel_size=8",
                             "evaluate.serve_args=[--tensor-parallel-size, '4']"])
    argv = server_args(own)["baseline"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--tensor-parallel-size"] == ["8", "4"]
