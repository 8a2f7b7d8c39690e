"""Smoke test of an installed pagedkv wheel, run from outside the source tree by scripts/test_wheel.sh.

Checks that pagedkv comes from the environment (not a checkout), that its build record names the
torch it runs with, that the three ops agree with pagedkv.reference (`python -m pagedkv`'s
self-test), and, when transformers is installed, that a tiny random Llama generates the same greedy
tokens with attn_implementation="pagedkv" as with "sdpa".
"""

from __future__ import annotations

import os
import sys
import sysconfig

import torch

import pagedkv
from pagedkv import __main__ as cli

NEW_TOKENS = 8


def check(condition, message):
    if not condition:
        print(f"FAILED: {message}")
        sys.exit(1)
    print(f"ok: {message}")


def transformers_tokens_match():
    import transformers

    import pagedkv.hf  # noqa: F401  (registers attn_implementation="pagedkv")

    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # weights far from the tiny default init, so attention is far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    tokens = {}
    for implementation in ("sdpa", "pagedkv"):
        model.set_attn_implementation(implementation)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        tokens[implementation] = out[:, ids.shape[1] :]
    return transformers.__version__, torch.equal(tokens["sdpa"], tokens["pagedkv"])


def main():
    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    where = os.path.realpath(pagedkv.__file__)
    check(where.startswith(site + os.sep), f"pagedkv imported from the environment ({where})")
    info = pagedkv.build_info()
    check(info["torch_built_against"] == torch.__version__, f"built against the running torch {torch.__version__}")
    for line in cli.report_lines(info):
        print("  " + line)
    for name, ok, detail in cli.self_test("cpu"):
        check(ok, f"self-test cpu {name} ({detail})")
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers not installed: transformers path skipped")
        return
    version, same = transformers_tokens_match()
    check(same, f"transformers {version}: random Llama greedy tokens with pagedkv equal sdpa's")


if __name__ == "__main__":
    main()
