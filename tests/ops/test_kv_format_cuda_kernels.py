"""Packed MLA rows (kv_format) on each CUDA kernel that reads them: flash_attn_paged_sparse's tiled
kernel (cp.async, and TMA gather4 with the rope as a second, byte-offset map where the GPU has it) and
its portable kernel, and flash_attn_paged's portable kernel, each against the float64 reference.
CUDA only (skips here without a GPU); the CPU cases are tests/ops/test_kv_format.py's."""

from __future__ import annotations

import pytest
import torch

from conftest import CUDA_ONLY, supported_or_skip
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
    """MLA's one latent head (D 576, Dv 512: V a view of K's first 512 channels) on the portable
    kernel, decode and chunked prefill, a bf16 cache and an e4m3 one with scales per 64 channels,
    window and sinks on, against the float64 reference."""
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
