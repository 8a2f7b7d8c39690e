"""Index tensors that change while an op runs: the process must survive, every time.

The ops release the GIL, so another Python thread may rewrite a lookup table, the cache lengths or
the row offsets between the op's checks and its kernels' reads. The CPU ops copy the offsets and
lengths once and check the copy, and read each page id once, masked to the pool
(RELIABILITY.md, "Aliasing and concurrent mutation"): results are then unspecified, but no kernel
reads or writes outside its tensors. Each case runs in a subprocess (a wild read would kill it):
one thread calls paged_store, paged_load and flash_attn_paged (functional, .out and _lse) in a
loop while another flips the index tensors between valid values and values far outside the pool
(page ids near 2^31, negative, lengths past the table). A call may fail its check with a
RuntimeError naming the argument; anything else (a crash, another error) fails the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent(
    r"""
    import sys, threading, time, torch, pagedkv
    cache_dtype, seconds, device = getattr(torch, sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    torch.set_default_device(device)
    # CUDA: the racer writes on its own stream, so its writes land while the op's kernels run
    side = torch.cuda.Stream() if device == "cuda" else None
    torch.manual_seed(0)
    P, HK, D, B, L = 16, 2, 64, 3, 700
    pages = B * (L + 16) // P + 4
    fp8 = cache_dtype.itemsize == 1
    k = torch.randn(pages, P, HK, D).to(cache_dtype)
    v = torch.randn(pages, P, HK, D).to(cache_dtype)
    ks = torch.ones(pages, P, HK, 1) if fp8 else None
    vs = torch.ones(pages, P, HK, 1) if fp8 else None
    cols = (L + 16) // P + 1
    table_ok = torch.randperm(pages)[: B * cols].to(torch.int32).view(B, cols)
    lengths_ok = torch.full((B,), L, dtype=torch.int32)
    offsets_ok = torch.tensor([0, 4, 5, 12], dtype=torch.int32)
    table, lengths, offsets = table_ok.clone(), lengths_ok.clone(), offsets_ok.clone()
    q = torch.randn(12, 8, D).to(torch.bfloat16)
    key = torch.randn(12, HK, D)
    out = torch.empty(12, 8, D, dtype=torch.bfloat16)
    seq_lens = lengths.clone()
    load_offsets = torch.tensor([0, L, 2 * L, 3 * L], dtype=torch.int32)
    load_out = torch.empty(3 * L, HK, D)
    for target in ("table", "lengths", "offsets", "seq_lens"):
        bad_values = {
            "table": [2**31 - 1, -5, pages, 10**9],
            "lengths": [2**31 - 1, 10**6, -3],
            "offsets": [2**31 - 1, 10**6, -7],
            "seq_lens": [2**31 - 1, 10**6, -1],
        }[target]
        victim = {"table": table, "lengths": lengths, "offsets": offsets, "seq_lens": seq_lens}[target]
        valid = victim.clone()
        stop = False

        def racer():
            if side is not None:
                torch.cuda.set_stream(side)
            i = 0
            while not stop:
                if i % 2:
                    victim.copy_(valid)
                else:
                    victim[i % victim.shape[0]] = bad_values[i // 2 % len(bad_values)]
                i += 1

        t = threading.Thread(target=racer)
        t.start()
        calls = refused = 0
        end = time.time() + seconds
        try:
            while time.time() < end:
                for op in range(5):
                    try:
                        if op == 0:
                            pagedkv.flash_attn_paged(q, offsets, k, v, lengths, table, k_scales=ks, v_scales=vs, quant_group=128)
                        elif op == 1:
                            pagedkv.flash_attn_paged_lse(q, offsets, k, v, lengths, table, k_scales=ks, v_scales=vs,
                                                         quant_group=128, window_left=40)
                        elif op == 2:
                            torch.ops.pagedkv.flash_attn_paged.out(q, offsets, k, v, lengths, table, None, True, ks, vs,
                                                                   128, -1, 0.0, out=out)
                        elif op == 3:
                            pagedkv.paged_store(key, key, k, v, offsets, lengths, table, ks if fp8 else None,
                                                vs if fp8 else None, 128)
                        else:
                            torch.ops.pagedkv.paged_load(k, ks, table, seq_lens, load_offsets, load_out, 128)
                    except RuntimeError as e:
                        refused += 1
                        if not any(n in str(e) for n in ("lookup_table", "cache_lengths", "input_row_offsets",
                                                          "seq_lens", "output_row_offsets", "q.size(0)", "key.size(0)")):
                            raise
                    calls += 1
        finally:
            stop = True
            t.join()
            if side is not None:
                torch.cuda.synchronize()  # an access fault of any kernel surfaces here
            victim.copy_(valid)  # the next target starts from valid tensors
        print(f"{target}: {calls} calls, {refused} refused by their checks")
    """
)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn"])
def test_index_tensors_rewritten_during_calls_never_crash(cache_dtype, device):
    """Each of the table, lengths, offsets and seq_lens raced for 1.5 s, in one subprocess per dtype
    (CUDA: without host checks, so every call runs; the kernels mask what they read)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, cache_dtype, "1.5", device], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert proc.stdout.count(" calls,") == 4, proc.stdout
