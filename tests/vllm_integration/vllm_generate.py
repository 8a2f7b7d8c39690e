"""Greedy generation through ``vllm.LLM``, written as JSON: the tests' one way to run vLLM offline.

vLLM registers its attention backend once per process, so pagedkv and vLLM's own backend are
compared across processes (``PAGEDKV_VLLM=1`` in the environment picks pagedkv); one process may run
several engines in turn, one per block size and KV cache dtype given (an engine start is seconds, the
process start with vLLM's imports most of a run). The workload exercises what the backend must get right: chunked prefill mixed with
decodes (``max_num_batched_tokens`` far below the prompt lengths), and prefix caching (a second
round of prompts that share a first-round prompt's leading pages).

    python tests/vllm_integration/vllm_generate.py --model DIR --dtype float32 --block-size 16 --out OUT.json
    python tests/vllm_integration/vllm_generate.py --model DIR --block-size 16 128 --kv-cache-dtype fp8 fp8_e5m2 --out OUT.json

OUT.json holds one entry of "runs" per (block size, KV cache dtype), in the order of the arguments.
"""

import argparse
import gc
import itertools
import json
import os

# The engine runs in this process: on a 2-core machine, two more spawned processes (engine core,
# worker) would each import vLLM again.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MAX_NEW_TOKENS = 12
TOP_LOGPROBS = 2
# Over two pages of 16 tokens, so the second round's prompts (which start with it) hit the prefix cache.
PREAMBLE = ("You are a careful assistant. Answer in one short sentence, with plain words, and do not repeat "
            "the question. Facts first, then stop.")
FIRST_ROUND = [
    "The capital of France is",
    PREAMBLE + " Question: what is the largest planet in the solar system? Answer:",
    "1, 2, 3, 4, 5,",
]
SECOND_ROUND = [
    PREAMBLE + " Question: which river runs through Paris? Answer:",
    PREAMBLE + " Question: what is the largest planet in the solar system? Answer: Jupiter. Question: and the smallest?"
    " Answer:",
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, nargs="+", default=[16])
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"],
                        help="vLLM's kv_cache_dtype: auto, fp8, fp8_e4m3, fp8_e5m2, ...")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=32)
    parser.add_argument("--token-prompts", action="store_true",
                        help="pass the prompts' UTF-8 bytes as token ids, for a model without a tokenizer")
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def completions(prompts, outputs):
    rows = []
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        rows.append({
            "prompt": prompt,
            "text": completion.text,
            "token_ids": list(completion.token_ids),
            # per generated token: {token id: logprob} for the chosen token and the top TOP_LOGPROBS
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in completion.logprobs],
        })
    return rows


def generate(args, block_size: int, kv_cache_dtype: str) -> dict:
    """One engine: both rounds of prompts, greedy; returns this run's entry of the output's "runs"."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=512,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=8,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        enforce_eager=True,  # no torch.compile: minutes on 2 cores, and attention runs eagerly anyway
        kv_cache_memory_bytes=128 << 20,
        gpu_memory_utilization=0.1,  # on CPU: the share of RAM vLLM insists on finding free at start
        seed=0,
        disable_log_stats=False,  # the prefix-cache hit counter below
        skip_tokenizer_init=args.token_prompts,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=TOP_LOGPROBS, ignore_eos=True,
                            detokenize=not args.token_prompts)

    def inputs(prompts):
        if args.token_prompts:
            return [{"prompt_token_ids": list(prompt.encode())} for prompt in prompts]
        return prompts

    def prefix_hits():
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")

    hits_before = prefix_hits()  # the counter may outlive an engine of the same process
    rows = []
    for prompts in (FIRST_ROUND, SECOND_ROUND):
        rows += completions(prompts, llm.generate(inputs(prompts), params, use_tqdm=False))
    run = {"block_size": block_size, "kv_cache_dtype": kv_cache_dtype, "completions": rows,
           "prefix_cache_hits": prefix_hits() - hits_before}
    del llm
    gc.collect()
    return run


def main() -> None:
    args = parse_args()
    runs = []
    for block_size, kv_cache_dtype in itertools.product(args.block_size, args.kv_cache_dtype):
        if runs:  # the previous engine's process group and memory go before the next engine starts
            from vllm.distributed import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        runs.append(generate(args, block_size, kv_cache_dtype))
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "pagedkv": os.environ.get("PAGEDKV_VLLM") == "1", "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
