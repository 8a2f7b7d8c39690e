"""MLA caches on each CUDA kernel that reads them: flash_attn_paged's MLA kernel (bf16 K-only caches and
packed rows), flash_attn_paged_sparse's tiled kernel (cp.async, and TMA gather4 with the rope as a
second, byte-offset map where the GPU has it) and its portable kernel, and flash_attn_paged's portable
kernel (e.g. FP8 K-only caches with scale groups), each against the float64 reference.
CUDA only (skips here without a GPU); the CPU cases are tests/ops/test_kv_format.py's."""

from __future__ import annotations

import pytest
import torch

from conftest import CUDA_ONLY, make_batch, supported_or_skip
from op_helpers import *  # noqa: F403
from test_kv_format import KEY_DIM, LATENT_DIM, producer_rows, tensor_scale

FORMATS = ["fp8_ds_mla", "fp8_rope"]
# (cuda_loader, cuda_sparse_kernel): the tiled kernel per loader, and the portable one
SPARSE_KERNELS = [("cp.async", "auto"), ("tma-gather4", "auto"), ("auto", "portable")]


@CUDA_ONLY
@pytest.mark.parametrize("loader, sparse_kernel", SPARSE_KERNELS)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_sparse_kernels_read_packed_rows(kernel_options, kv_format, loader, sparse_kernel):
    gen = generator(seed_from("cuda-sparse", kv_format))
    # 70 listed tokens: three 32-row tiles (the tiled kernel's double buffer turns over), 20 query
    # heads (two head chunks of the tiled kernel), pages of 64
    num_pages, page_size, tokens, heads, top_k = 6, 64, 3, 20, 70
    scale = tensor_scale(kv_format)
    cache = producer_rows(gen, kv_format, (num_pages, page_size, 1), scale)
    indices = torch.randint(0, num_pages * page_size, (tokens, 1, top_k), generator=gen, dtype=torch.int32)
    indices[0, 0, 10:40] = -1
    indices[2, 0, 5] = indices[2, 0, 6]
    q = randn(gen, (tokens, heads, KEY_DIM), torch.bfloat16)
    expected = ref.flash_attn_paged_sparse(q, cache, None, indices, k_scales=scale, kv_format=kv_format)
    kernel_options(cuda_loader=loader, cuda_sparse_kernel=sparse_kernel)
    on = (lambda t: None if t is None else t.to("cuda"))
    try:
        out = supported_or_skip("cuda", pagedkv.flash_attn_paged_sparse, on(q), on(cache), None, on(indices),
                                k_scales=on(scale), kv_format=kv_format)
    except RuntimeError as error:  # a forced loader this GPU lacks (gather4 before Blackwell)
        if "is not available" in str(error):
            pytest.skip(str(error))
        raise
    assert out.shape == (tokens, heads, LATENT_DIM)
    assert_attention_close(out.cpu(), expected, torch.bfloat16, f"sparse {kv_format} {loader} {sparse_kernel}")


@CUDA_ONLY
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("new, cached", [([1, 1, 1], [700, 64, 3]), ([40, 7], [100, 0])], ids=["decode", "prefill"])
def test_dense_mla_k_only_cache(cache_dtype, new, cached):
    """MLA's one latent head (D 576, Dv 512: V a view of K's first 512 channels), decode and chunked
    prefill, a bf16 cache (the MLA kernel) and an e4m3 one with scales per 64 channels (the portable
    kernel), window and sinks on, against the float64 reference."""
    gen = generator(seed_from("cuda-mla", cache_dtype, new))
    page_size, heads = 64, 16
    pages = [-(-(c + n) // page_size) for c, n in zip(cached, new)]
    num_pages = len(new) * max(pages) + 2
    table = torch.randperm(num_pages, generator=gen)[: len(new) * max(pages)].to(torch.int32).view(len(new), -1)
    keys = randn(gen, (num_pages, page_size, 1, KEY_DIM))
    scales = None
    if cache_dtype == torch.bfloat16:
        cache = keys.to(torch.bfloat16)
    else:
        groups = keys.view(*keys.shape[:3], KEY_DIM // 64, 64)
        scales = (groups.abs().amax(-1) / 448).clamp_min(1e-6)
        cache = (groups / scales[..., None]).to(cache_dtype).view(keys.shape)
    offsets = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    lengths = torch.tensor(cached, dtype=torch.int32)
    q = randn(gen, (int(offsets[-1]), heads, KEY_DIM), torch.bfloat16)
    sinks = randn(gen, (heads,))
    v_scales = None if scales is None else scales[..., : LATENT_DIM // 64]  # V's groups: K's first 8
    kwargs = dict(k_scales=scales, v_scales=v_scales, quant_group=64, window_left=300, sinks=sinks)
    expected = ref.flash_attn_paged(q.double(), offsets, cache, cache[..., :LATENT_DIM], lengths, table, **kwargs)
    on = (lambda t: None if t is None else t.to("cuda"))
    cuda_cache = cache.cuda()
    out = pagedkv.flash_attn_paged(on(q), on(offsets), cuda_cache, cuda_cache[..., :LATENT_DIM], on(lengths),
                                   on(table), **{k: on(v) if isinstance(v, torch.Tensor) else v
                                                 for k, v in kwargs.items()})
    assert_attention_close(out.cpu(), expected, torch.bfloat16, f"MLA {cache_dtype}")


@CUDA_ONLY
@pytest.mark.parametrize("kv_format", FORMATS)
def test_host_checks_read_the_per_tensor_scale_on_the_host(kernel_options, kv_format):
    """With host checks on, the shims copy a per-tensor scale to the host before its value check: for
    packed rows V's scales are K's (the caller's k_scales), never a device pointer read on the host."""
    kernel_options(checks=True)
    gen = generator(seed_from("cuda-checks", kv_format))
    num_pages, page_size, heads = 3, 16, 16
    scale = tensor_scale(kv_format)
    cache = producer_rows(gen, kv_format, (num_pages, page_size, 1), scale)
    offsets = torch.tensor([0, 1], dtype=torch.int32)
    lengths = torch.tensor([40], dtype=torch.int32)
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    q = randn(gen, (1, heads, KEY_DIM), torch.bfloat16)
    indices = torch.arange(0, 48, 3, dtype=torch.int32).view(1, 1, -1)
    on = (lambda t: None if t is None else t.to("cuda"))
    dense = pagedkv.flash_attn_paged(on(q), on(offsets), on(cache), None, on(lengths), on(table),
                                     k_scales=on(scale), kv_format=kv_format)
    sparse = pagedkv.flash_attn_paged_sparse(on(q), on(cache), None, on(indices), k_scales=on(scale),
                                             kv_format=kv_format)
    assert_attention_close(dense.cpu(), ref.flash_attn_paged(q, offsets, cache, None, lengths, table, k_scales=scale,
                                                             kv_format=kv_format), torch.bfloat16, "dense, checks on")
    assert_attention_close(sparse.cpu(), ref.flash_attn_paged_sparse(q, cache, None, indices, k_scales=scale,
                                                                     kv_format=kv_format),
                           torch.bfloat16, "sparse, checks on")


@CUDA_ONLY
@pytest.mark.parametrize("splits", [0, 1, 3], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("heads", [16, 20, 128])
@pytest.mark.parametrize("cache_kind", ["bfloat16", *FORMATS])
def test_mla_kernel_long_rows_and_unseen_nan(kernel_options, cache_kind, heads, splits):
    """flash_attn_paged's MLA kernel (16 query heads per CTA, 32-key tiles, V read from the K tile) on a
    bf16 K-only cache and on packed rows: rows of 3000 and 1500 cached keys (many tiles per CTA), a causal
    40-token chunk, a decode row with no history, a window, sinks and LSE, 16 / 20 (a partial head block)
    / 128 heads, the plan's split count, one split and three. Every slot that no query row sees (unused
    pages, the tails of rows' last pages, keys before the window) holds NaN bytes; finite output equal
    to the reference."""
    kernel_options(cuda_splits=splits)
    gen = generator(seed_from("mla kernel", cache_kind, heads, splits))
    page_size, window = 64, 1000
    rows = [(3000, 1), (1500, 40), (0, 1), (33, 1)]
    batch, num_pages = make_batch(gen, rows, page_size=page_size, padding=1)
    packed = cache_kind != "bfloat16"
    scale = tensor_scale(cache_kind) if packed else None
    if packed:
        cache = producer_rows(gen, cache_kind, (num_pages, page_size, 1), scale)
    else:
        cache = randn(gen, (num_pages, page_size, 1, KEY_DIM)).to(torch.bfloat16)
    seen = torch.zeros((num_pages, page_size), dtype=torch.bool)
    for b, (cached, new) in enumerate(rows):
        keys = torch.arange(max(cached - window, 0), cached + new)
        seen[batch.lookup_table[b, keys // page_size].long(), keys % page_size] = True
    cache[~seen] = 255 if packed else float("nan")  # packed: NaN codes, scales and rope
    q = randn(gen, (batch.num_tokens, heads, KEY_DIM), torch.bfloat16)
    sinks = randn(gen, (heads,))
    kwargs = dict(window_left=window, sinks=sinks)
    if packed:
        kwargs.update(k_scales=scale, kv_format=cache_kind)
    args = (batch.input_row_offsets, cache, None if packed else cache[..., :LATENT_DIM], batch.cache_lengths,
            batch.lookup_table)
    expected, expected_lse = ref.flash_attn_paged_lse(q.double(), *args, **kwargs)
    cuda_cache = cache.cuda()
    cuda_args = (batch.input_row_offsets.cuda(), cuda_cache, None if packed else cuda_cache[..., :LATENT_DIM],
                 batch.cache_lengths.cuda(), batch.lookup_table.cuda())
    out, lse = pagedkv.flash_attn_paged_lse(q.cuda(), *cuda_args, **{
        k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    what = f"MLA kernel, {cache_kind}, {heads} heads, splits {splits}"
    assert_attention_close(out, expected, torch.bfloat16, what, q16_on_cuda=True)
    assert_lse_close(lse, expected_lse, torch.bfloat16, what, q16_on_cuda=True)
