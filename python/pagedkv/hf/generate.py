"""Continuous batching of a transformers model on pagedkv's server (``pagedkv.serving``), page
manager, cache and kernels: ``generate_batch`` and the model adapter it drives."""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import torch

from ..cache import PagedKVCacheCollection, _check_cache_dtype, _check_positive_int
from ..serving import ContinuousBatchingServer, ProgressBar, Request, page_manager_for
from .cache import PagedCache, _model_dims, _RaggedStep, _text_config
from .compat import IMPLEMENTATION


def _cache_argument(model) -> str:
    """The name this transformers version's forward takes the cache under."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class TransformersPagedModel:
    """A transformers causal LM behind the model interface of ``pagedkv.serving``'s server:
    ``model(tokens, positions, input_row_offsets, cache_lengths, lookup_table) -> logits [B, V]``.

    Each call is one packed forward (``input_ids [1, T]``) whose attention layers store into and
    read from ``kv_cache`` (a ``PagedKVCacheCollection``) with the given page table.
    """

    def __init__(self, model, kv_cache: PagedKVCacheCollection):
        config = _text_config(model)
        if getattr(config, "_attn_implementation", None) != IMPLEMENTATION:
            raise ValueError(
                f"TransformersPagedModel needs attn_implementation='{IMPLEMENTATION}', "
                f"got '{getattr(config, '_attn_implementation', None)}' (load the model with it or call "
                f"model.set_attn_implementation('{IMPLEMENTATION}'))"
            )
        self.model = model
        self.kv_cache = kv_cache
        self.cache = PagedCache(model, page_size=kv_cache.page_size, collection=kv_cache)
        self.cache_argument = _cache_argument(model)

    @torch.inference_mode()
    def __call__(self, tokens, positions, input_row_offsets, cache_lengths, lookup_table) -> torch.Tensor:
        num_rows = cache_lengths.shape[0]
        last_rows = input_row_offsets[1 : num_rows + 1].long() - 1  # [B]
        self.cache.ragged = _RaggedStep(input_row_offsets, cache_lengths, lookup_table)
        try:
            output = self.model(
                input_ids=tokens.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=True,
                logits_to_keep=last_rows,
                **{self.cache_argument: self.cache},
            )
        finally:
            self.cache.ragged = None
        return output.logits[0].float()  # [B, vocab]


def generate_batch(
    model,
    inputs: Sequence[Sequence[int]],
    max_new_tokens: int | None = None,
    *,
    generation_config=None,
    eos_token_id: int | Sequence[int] | None = None,
    page_size: int = 16,
    num_pages: int | None = None,
    kv_dtype: torch.dtype | None = None,
    max_prefill_tokens: int = 512,
    max_running: int = 16,
    progress: bool = False,
) -> list[list[int]]:
    """Greedy continuous batching of ``inputs`` (token id lists) with a transformers model on
    pagedkv's page manager, cache and kernels; returns the generated ids of each input (ending
    with the EOS token when one stopped it).

    max_new_tokens / eos_token_id default to ``generation_config`` (a transformers
    GenerationConfig, as for transformers' own ``generate_batch``), then to the model's
    ``generation_config``, then to 32 / none (``eos_token_id=[]``: never stop early). Sampling is
    not supported (``do_sample`` must be False).

    Requests are admitted while their prefill fits ``max_prefill_tokens`` and pages are free;
    decode and prefill rows share each forward; a request that runs out of pages is preempted
    and recomputed later; full pages of a shared prompt prefix are computed once.
    """
    if not inputs:
        return []
    for source in (generation_config, getattr(model, "generation_config", None)):
        if source is None:
            continue
        if source is generation_config and getattr(source, "do_sample", False):
            raise ValueError("generate_batch: generation_config.do_sample must be False (greedy decoding only)")
        if max_new_tokens is None:
            max_new_tokens = getattr(source, "max_new_tokens", None)
        if eos_token_id is None:
            eos_token_id = getattr(source, "eos_token_id", None)
    max_new_tokens = 32 if max_new_tokens is None else max_new_tokens
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    prompts = [[int(t) for t in ids] for ids in inputs]
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"inputs[{i}] is empty: every request needs at least one prompt token")
    # Checked before they size the pool: page_size=0 would divide by zero there, a negative one
    # would surface as a "num_pages" the caller never passed, and a bad kv_dtype as "dtype".
    _check_positive_int("page_size", page_size)
    if num_pages is not None:
        _check_positive_int("num_pages", num_pages)
    if kv_dtype is not None:
        _check_cache_dtype(kv_dtype, "kv_dtype")
    config = _text_config(model)
    num_layers, num_kv_heads, head_dim = _model_dims(config)
    stop_ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    longest = max(len(p) for p in prompts) + max_new_tokens
    if num_pages is None:
        num_pages = min(len(prompts), max_running) * math.ceil(longest / page_size) + 1
    device = next(model.parameters()).device
    dtype = kv_dtype or next(model.parameters()).dtype
    collection = PagedKVCacheCollection(num_pages, num_layers, page_size, num_kv_heads, head_dim,
                                        dtype=dtype, device=device)
    manager = page_manager_for(collection)
    server = ContinuousBatchingServer(TransformersPagedModel(model, collection), manager, stop_ids, device,
                                      max_prefill_tokens=max_prefill_tokens, max_running=max_running)
    requests = [Request(request_id=i, arrival_step=0, message="", prompt=p, max_new_tokens=max_new_tokens)
                for i, p in enumerate(prompts)]
    for request in requests:
        server.submit(request)
    bar = ProgressBar(len(requests), enabled=progress)
    while server.has_work():
        server.step()
        bar.update(len(server.finished), len(requests), f"running {len(server.running)}")
    bar.close()
    return [r.generated for r in requests]
