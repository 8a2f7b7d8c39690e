"""PagedMLACache (packed MLA rows, CONTRACT v1.2 kv_format): geometry, round trips through the ops
against the reference, copy-on-write of packed pages by the page manager, torch.compile of a layer
over it, and examples/mla_layer.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import pagedkv
from conftest import DEVICES, assert_attention_close, assert_bytes_equal, make_batch, randn, supported_or_skip
from pagedkv import reference as ref
from pagedkv.cache import PagedMLACache
from pagedkv.kv_formats import KEY_DIM, KV_FORMATS, LATENT_DIM

FORMATS = list(KV_FORMATS)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("kv_format", FORMATS)
def test_geometry(kv_format):
    cache = PagedMLACache(6, 4, kv_format=kv_format, num_layers=2)
    row_bytes = KV_FORMATS[kv_format].row_bytes
    assert [tuple(p.shape) for p in cache.k_pools] == [(6, 4, 1, row_bytes)] * 2
    assert all(p.dtype == torch.uint8 for p in cache.k_pools)
    assert cache.k_cache(1) is cache.k_pools[1] and cache.v_cache(1) is None and cache.v_scales(1) is None
    assert (cache.head_dim, cache.v_head_dim, cache.kv_format) == (KEY_DIM, LATENT_DIM, kv_format)
    if kv_format == "fp8_rope":
        assert cache.tensor_scales.shape == (2, 1) and torch.equal(cache.tensor_scales, torch.ones(2, 1))
        scale = cache.k_scales(1)
        assert scale.dim() == 0 and scale.data_ptr() == cache.tensor_scales[1, 0].data_ptr()
    else:
        assert cache.tensor_scales is None and cache.k_scales(1) is None


def test_constructor_and_call_errors():
    for bad in (None, "fp8", "fp8_e4m3"):
        with pytest.raises(ValueError, match="kv_format"):
            PagedMLACache(4, 4, kv_format=bad)
    with pytest.raises(ValueError, match="num_pages"):
        PagedMLACache(0, 4)
    with pytest.raises(ValueError, match="device"):
        PagedMLACache(4, 4, device="meta")
    cache = PagedMLACache(4, 4, num_layers=2)
    offsets, lengths = torch.tensor([0, 2], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    table = torch.tensor([[1]], dtype=torch.int32)
    key = torch.randn(2, 1, KEY_DIM)
    with pytest.raises(ValueError, match="value"):
        cache.store(0, key, key, offsets, lengths, table)
    with pytest.raises(ValueError, match="layer"):
        cache.store(2, key, None, offsets, lengths, table)
    with pytest.raises(ValueError, match="v_head_dim"):
        cache.attention(0, torch.randn(2, 4, KEY_DIM), offsets, lengths, table, v_head_dim=128)
    with pytest.raises(ValueError, match="which"):
        cache.load(0, table, torch.tensor([2], dtype=torch.int32), which="v")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_store_load_attention_round_trip(device, kv_format):
    gen = torch.Generator().manual_seed(7)
    cache = PagedMLACache(10, 4, kv_format=kv_format, num_layers=2, device=device)
    if kv_format == "fp8_rope":
        cache.tensor_scales[1, 0] = 0.01  # a calibrated scale: |latent / s| reaches 448 (clamped)
    rows = [(0, 7), (0, 3), (0, 0)]
    batch, _ = make_batch(gen, rows, page_size=4, num_pages=10, device=device)
    key = randn(gen, (10, 1, KEY_DIM), device=device)
    layer0 = cache.k_pools[0].clone()
    cache.store(1, key, None, batch.input_row_offsets, batch.cache_lengths, batch.lookup_table)
    assert torch.equal(cache.k_pools[0], layer0), "layer 0 changed"
    expected_rows = ref.pack_mla_rows(key.cpu(), kv_format, None if cache.k_scales(1) is None
                                      else cache.k_scales(1).cpu())
    loaded = cache.load(1, batch.lookup_table, batch.seq_lens)
    assert loaded.dtype == torch.float32 and loaded.shape == (10, 1, KEY_DIM)
    scale = None if cache.k_scales(1) is None else cache.k_scales(1).cpu()
    assert_bytes_equal(loaded.cpu(), ref.unpack_mla_rows(expected_rows, kv_format, scale, torch.float32), "load")

    # one decode token for rows 0 and 1, then attend (one padding row)
    offsets = torch.tensor([0, 1, 2, 2], dtype=torch.int32, device=device)
    lengths = torch.tensor([7, 3, 0], dtype=torch.int32, device=device)
    cache.store(1, randn(gen, (2, 1, KEY_DIM), device=device), None, offsets, lengths, batch.lookup_table)
    q = randn(gen, (3, 16, KEY_DIM), torch.bfloat16, device)
    out = supported_or_skip(device, cache.attention, 1, q, offsets, lengths, batch.lookup_table, softcap=30.0)
    expected = ref.flash_attn_paged(q.cpu(), offsets.cpu(), cache.k_cache(1).cpu(), None, lengths.cpu(),
                                    batch.lookup_table.cpu(), k_scales=scale, softcap=30.0, kv_format=kv_format)
    assert out.shape == (3, 16, LATENT_DIM)
    assert_attention_close(out, expected, torch.bfloat16, f"{kv_format} cache attention")
    assert (out[2] == 0).all()


@pytest.mark.parametrize("kv_format", FORMATS)
def test_page_manager_copies_packed_pages(kv_format):
    """A fork shares the pages; the first write into the shared last page copies it (every byte of the
    packed rows), and each sequence then attends over its own tokens."""
    gen = torch.Generator().manual_seed(11)
    cache = PagedMLACache(8, 4, kv_format=kv_format, num_layers=2)
    manager = pagedkv.PageManager(8, 4, caches=cache.k_pools)
    manager.add_sequence(0)
    manager.reserve(0, 6)
    table, lengths = manager.export([0])
    prompt = randn(gen, (6, 1, KEY_DIM))
    for layer in range(2):
        cache.store(layer, prompt, None, torch.tensor([0, 6], dtype=torch.int32), lengths, table)
    manager.commit(0, 6)
    manager.fork(0, 1)
    for seq in (0, 1):
        manager.reserve(seq, 1)
    table, lengths = manager.export([0, 1])
    assert table[0, 1] != table[1, 1], "the shared last page must have been copied"
    assert torch.equal(cache.k_pools[1][table[1, 1]], cache.k_pools[1][table[0, 1]])
    offsets = torch.tensor([0, 1, 2], dtype=torch.int32)
    step = randn(gen, (2, 1, KEY_DIM))
    cache.store(1, step, None, offsets, lengths, table)
    q = randn(gen, (2, 16, KEY_DIM))
    out = cache.attention(1, q, offsets, lengths, table)
    for b in range(2):
        history = torch.cat([prompt, step[b : b + 1]])
        scale = cache.k_scales(1)
        alone = PagedMLACache(2, 8, kv_format=kv_format)
        if scale is not None:
            alone.tensor_scales.copy_(cache.tensor_scales[1:])
        single = torch.tensor([[0]], dtype=torch.int32)
        alone.store(0, history, None, torch.tensor([0, 7], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                    single)
        expected = alone.attention(0, q[b : b + 1], torch.tensor([0, 1], dtype=torch.int32),
                                   torch.tensor([6], dtype=torch.int32), single)
        assert_attention_close(out[b : b + 1], expected, torch.float32, f"sequence {b}")


class TinyMLALayer(torch.nn.Module):
    """Latent key and absorbed query projections, paged_store into a PagedMLACache, attention."""

    def __init__(self, cache, hidden, num_heads):
        super().__init__()
        self.cache, self.num_heads = cache, num_heads
        self.key = torch.nn.Linear(hidden, KEY_DIM, bias=False)
        self.query = torch.nn.Linear(hidden, num_heads * KEY_DIM, bias=False)
        self.out = torch.nn.Linear(num_heads * LATENT_DIM, hidden, bias=False)

    def forward(self, x, input_row_offsets, cache_lengths, lookup_table):
        tokens = x.shape[0]
        self.cache.store(0, self.key(x).view(tokens, 1, KEY_DIM), None, input_row_offsets, cache_lengths,
                         lookup_table)
        o = self.cache.attention(0, self.query(x).view(tokens, self.num_heads, KEY_DIM), input_row_offsets,
                                 cache_lengths, lookup_table, softcap=20.0)
        return self.out(o.reshape(tokens, -1))


@pytest.mark.parametrize("kv_format, backend", [("fp8_ds_mla", "aot_eager"), ("fp8_rope", "aot_eager"),
                                                ("fp8_ds_mla", "inductor")])
def test_torch_compile_fullgraph(kv_format, backend):
    torch.manual_seed(0)
    caches = [PagedMLACache(6, 4, kv_format=kv_format) for _ in range(2)]
    eager = TinyMLALayer(caches[0], 32, 4)
    compiled_layer = TinyMLALayer(caches[1], 32, 4)
    compiled_layer.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_layer, backend=backend, fullgraph=True)
    table = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    with torch.no_grad():
        for offsets, lengths in [([0, 5, 7], [0, 0]), ([0, 1, 2], [5, 2])]:
            offsets = torch.tensor(offsets, dtype=torch.int32)
            lengths = torch.tensor(lengths, dtype=torch.int32)
            x = torch.randn((int(offsets[-1]) + 1, 32))  # one padding row
            expected = eager(x, offsets, lengths, table)
            torch.testing.assert_close(compiled(x, offsets, lengths, table), expected, rtol=1e-5, atol=1e-5)
    if backend == "aot_eager":  # the same aten kernels for the projections: the same bytes
        assert_bytes_equal(caches[1].k_pools[0], caches[0].k_pools[0], "compiled cache rows")


def test_mla_layer_example_runs():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "python"),
                                                                     os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "mla_layer.py")], capture_output=True,
                            text=True, env=env, timeout=600)  # a hang guard only
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout and "relative error" in result.stdout
