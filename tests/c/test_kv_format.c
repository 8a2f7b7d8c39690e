/* Unit tests of the packed MLA rows (kv_format, csrc/core/pkv_kv_format.c; run by tests/c/run.sh under
 * ASan + UBSan): format names, the plain views each unpack gives (byte offsets, element strides), the
 * refusals of the packed rules (each naming the caller's argument), and a store then load through the
 * CPU kernels checked byte for byte against the contract's rule. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pkv_numeric.h"
#include "pkv_cpu_ops.h"
#include "check.h"
#include "test_util.h"

#define EXPECT_STATUS(call, wanted, arg)                                                                         \
  do {                                                                                                           \
    pkv_error err_;                                                                                              \
    memset(&err_, 0, sizeof err_);                                                                               \
    pkv_status s_ = (call);                                                                                      \
    CHECK(s_ == (wanted), "%s: status %d, expected %d (%s)", #call, (int)s_, (int)(wanted), err_.message);         \
    if ((wanted) != PKV_OK)                                                                                      \
      CHECK(strstr(err_.message, arg) != NULL, "%s: message does not name %s: %s", #call, arg, err_.message);    \
  } while (0)

enum { N = 3, P = 4, T = 5, DS_ROW = 656, ROPE_ROW = 640, D = 576 };

/* uint32 storage keeps the rows 4-byte aligned, as the float32 scales need */
static uint32_t g_pool[N * P * DS_ROW / 4];
static float g_key[T * D], g_out[T * D], g_scale = 0.02f;
static int32_t g_offsets[2] = {0, T}, g_lengths[1] = {2}, g_seq[1] = {2 + T}, g_table[2] = {2, 0};

static pkv_tensor packed_cache(int64_t row) { return T4(g_pool, PKV_DTYPE_U8, N, P, 1, row); }

static pkv_store_args store_call(pkv_kv_format f) {
  pkv_store_args a;
  memset(&a, 0, sizeof a);
  a.key = T3(g_key, PKV_DTYPE_F32, T, 1, D);
  a.k_cache = packed_cache(f == PKV_KV_FP8_DS_MLA ? DS_ROW : ROPE_ROW);
  a.input_row_offsets = T1(g_offsets, PKV_DTYPE_I32, 2);
  a.cache_lengths = T1(g_lengths, PKV_DTYPE_I32, 1);
  a.lookup_table = T2(g_table, PKV_DTYPE_I32, 1, 2);
  if (f == PKV_KV_FP8_ROPE) a.k_scales = T1(&g_scale, PKV_DTYPE_F32, 1);
  a.quant_group = 128;
  a.kv_format = f;
  return a;
}

static void test_names(void) {
  pkv_kv_format f = PKV_KV_FP8_ROPE;
  CHECK(pkv_kv_format_parse(NULL, &f) && f == PKV_KV_PLAIN, "NULL is the plain format");
  CHECK(pkv_kv_format_parse("fp8_ds_mla", &f) && f == PKV_KV_FP8_DS_MLA, "fp8_ds_mla");
  CHECK(pkv_kv_format_parse("fp8_rope", &f) && f == PKV_KV_FP8_ROPE, "fp8_rope");
  CHECK(!pkv_kv_format_parse("fp8", &f) && !pkv_kv_format_parse("", &f), "unknown names refused");
  CHECK(pkv_kv_format_layout(PKV_KV_PLAIN) == NULL, "plain has no row layout");
  CHECK(pkv_kv_format_layout(PKV_KV_FP8_DS_MLA)->row_bytes == 656 &&
            pkv_kv_format_layout(PKV_KV_FP8_DS_MLA)->scales_offset == 512 &&
            pkv_kv_format_layout(PKV_KV_FP8_DS_MLA)->rope_offset == 528,
        "fp8_ds_mla row: 512 latent bytes, 16 scale bytes, 128 rope bytes");
  CHECK(pkv_kv_format_layout(PKV_KV_FP8_ROPE)->row_bytes == 640 &&
            pkv_kv_format_layout(PKV_KV_FP8_ROPE)->scales_offset == -1 &&
            pkv_kv_format_layout(PKV_KV_FP8_ROPE)->rope_offset == 512,
        "fp8_rope row: 512 latent bytes, 128 rope bytes");
}

static void test_store_views(void) {
  pkv_store_args a = store_call(PKV_KV_FP8_DS_MLA), parts[2];
  int n = 0;
  EXPECT_STATUS(pkv_store_unpack(&a, parts, &n, &err_), PKV_OK, "");
  CHECK(n == 2, "two plain stores, got %d", n);
  const pkv_tensor *lat = &parts[0].k_cache, *sc = &parts[0].k_scales, *rope = &parts[1].k_cache;
  char *base = (char *)g_pool;
  CHECK(lat->dtype == PKV_DTYPE_FP8_E4M3 && lat->data == base && lat->sizes[3] == 512 && lat->strides[1] == 656,
        "latent view");
  CHECK(sc->dtype == PKV_DTYPE_F32 && sc->data == base + 512 && sc->sizes[3] == 4 && sc->strides[1] == 164 &&
            sc->strides[0] == 164 * P && sc->strides[3] == 1,
        "scales view: data +512 B, token stride 164 floats");
  CHECK(rope->dtype == PKV_DTYPE_BF16 && rope->data == base + 528 && rope->sizes[3] == 64 && rope->strides[1] == 328,
        "rope view: data +528 B, token stride 328 bf16");
  CHECK(parts[0].key.sizes[2] == 512 && parts[0].key.data == (void *)g_key, "latent channels of the key");
  CHECK(parts[1].key.sizes[2] == 64 && parts[1].key.data == (void *)(g_key + 512), "rope channels of the key");
  CHECK(parts[0].quant_group == 128 && !parts[1].k_scales.defined, "groups of 128; no rope scales");
  for (int i = 0; i < n; i++) EXPECT_STATUS(pkv_store_check(&parts[i], 1, &err_), PKV_OK, "");

  pkv_store_args plain = store_call(PKV_KV_FP8_DS_MLA);
  plain.kv_format = PKV_KV_PLAIN;
  EXPECT_STATUS(pkv_store_unpack(&plain, parts, &n, &err_), PKV_OK, "");
  CHECK(n == 1 && parts[0].k_cache.data == plain.k_cache.data, "a plain call is itself");
}

static void test_refusals(void) {
  pkv_store_args parts[2];
  int n;
  uint8_t spare[16];
#define STORE_FAIL(f, mutation, arg)                                                       \
  do {                                                                                     \
    pkv_store_args b = store_call(f);                                                      \
    mutation;                                                                              \
    EXPECT_STATUS(pkv_store_unpack(&b, parts, &n, &err_), PKV_ERR_ARGUMENT, arg);          \
  } while (0)
  STORE_FAIL(PKV_KV_FP8_DS_MLA, b.k_cache.dtype = PKV_DTYPE_FP8_E4M3, "k_cache");
  STORE_FAIL(PKV_KV_FP8_DS_MLA, b.k_cache = packed_cache(640), "k_cache");
  STORE_FAIL(PKV_KV_FP8_ROPE, b.k_cache = packed_cache(656), "k_cache");
  STORE_FAIL(PKV_KV_FP8_DS_MLA, b.k_cache.sizes[2] = 2, "k_cache");
  STORE_FAIL(PKV_KV_FP8_DS_MLA, b.k_cache.data = (char *)g_pool + 2, "k_cache"); /* scales misaligned */
  STORE_FAIL(PKV_KV_FP8_DS_MLA, b.k_cache.strides[0] = 656 * P + 2, "k_cache");
  STORE_FAIL(PKV_KV_FP8_DS_MLA, b.v_cache = b.k_cache, "v_cache");
  STORE_FAIL(PKV_KV_FP8_DS_MLA, b.value = b.key, "value");
  STORE_FAIL(PKV_KV_FP8_DS_MLA, b.k_scales = T1(&g_scale, PKV_DTYPE_F32, 1), "k_scales");
  STORE_FAIL(PKV_KV_FP8_DS_MLA, b.v_scales = T1(&g_scale, PKV_DTYPE_F32, 1), "v_scales");
  STORE_FAIL(PKV_KV_FP8_ROPE, b.k_scales = none(), "k_scales");
  STORE_FAIL(PKV_KV_FP8_ROPE, b.k_scales = T1(spare, PKV_DTYPE_U8, 1), "k_scales");
  STORE_FAIL(PKV_KV_FP8_ROPE, b.k_scales = T4(g_key, PKV_DTYPE_F32, N, P, 1, 4), "k_scales");
  STORE_FAIL(PKV_KV_FP8_DS_MLA, b.key = T3(g_key, PKV_DTYPE_F32, T, 1, 512), "key");
  STORE_FAIL(PKV_KV_FP8_DS_MLA, b.key = none(), "key");
  /* the per-tensor scale's value is the plain check's (finite, > 0) */
  float bad = -1.0f;
  pkv_store_args b = store_call(PKV_KV_FP8_ROPE);
  b.k_scales = T1(&bad, PKV_DTYPE_F32, 1);
  EXPECT_STATUS(pkv_store_unpack(&b, parts, &n, &err_), PKV_OK, "");
  EXPECT_STATUS(pkv_store_check(&parts[0], 1, &err_), PKV_ERR_ARGUMENT, "k_scales");
  /* a plain check refuses an unpacked call */
  pkv_store_args packed = store_call(PKV_KV_FP8_DS_MLA);
  EXPECT_STATUS(pkv_store_check(&packed, 1, &err_), PKV_ERR_ARGUMENT, "unpacked");

  pkv_load_args l;
  memset(&l, 0, sizeof l);
  l.cache = packed_cache(DS_ROW);
  l.lookup_table = T2(g_table, PKV_DTYPE_I32, 1, 2);
  l.seq_lens = T1(g_seq, PKV_DTYPE_I32, 1);
  l.output_row_offsets = T1(g_offsets, PKV_DTYPE_I32, 2);
  l.out = T3(g_out, PKV_DTYPE_F32, T, 1, 512);
  l.quant_group = 128;
  l.kv_format = PKV_KV_FP8_DS_MLA;
  pkv_load_args lp[2];
  EXPECT_STATUS(pkv_load_unpack(&l, lp, &n, &err_), PKV_ERR_ARGUMENT, "out");
  l.out = T3(g_out, PKV_DTYPE_F32, T, 1, D);
  l.scales = T1(&g_scale, PKV_DTYPE_F32, 1);
  EXPECT_STATUS(pkv_load_unpack(&l, lp, &n, &err_), PKV_ERR_ARGUMENT, "scales");

  static float q[T * 2 * D], out[T * 2 * 512];
  pkv_attn_args a;
  memset(&a, 0, sizeof a);
  a.q = T3(q, PKV_DTYPE_F32, T, 2, D);
  a.out = T3(out, PKV_DTYPE_F32, T, 2, 512);
  a.input_row_offsets = T1(g_offsets, PKV_DTYPE_I32, 2);
  a.k_cache = packed_cache(DS_ROW);
  a.cache_lengths = T1(g_lengths, PKV_DTYPE_I32, 1);
  a.lookup_table = T2(g_table, PKV_DTYPE_I32, 1, 2);
  a.scale = 0.04;
  a.causal = 1;
  a.quant_group = 128;
  a.window_left = -1;
  a.kv_format = PKV_KV_FP8_DS_MLA;
  pkv_attn_args plain;
  EXPECT_STATUS(pkv_attn_unpack(&a, &plain, &err_), PKV_OK, "");
  CHECK(plain.k_tail_dim == 64 && plain.k_tail_offset == 528 && plain.k_cache.data == plain.v_cache.data &&
            plain.v_cache.sizes[3] == 512 && plain.k_scales.data == (char *)g_pool + 512,
        "attention: K = V = the latent view, the rope a 64-channel tail at +528 B");
  EXPECT_STATUS(pkv_attn_check(&plain, 1, &err_), PKV_OK, "");
  pkv_attn_args wrong = a;
  wrong.q = T3(q, PKV_DTYPE_F32, T, 2, 512);
  EXPECT_STATUS(pkv_attn_unpack(&wrong, &plain, &err_), PKV_ERR_ARGUMENT, "q");
  wrong = a;
  wrong.out = T3(out, PKV_DTYPE_F32, T, 1, D);
  EXPECT_STATUS(pkv_attn_unpack(&wrong, &plain, &err_), PKV_ERR_ARGUMENT, "out");
  wrong = a;
  wrong.v_cache = a.k_cache;
  EXPECT_STATUS(pkv_attn_unpack(&wrong, &plain, &err_), PKV_ERR_ARGUMENT, "v_cache");
  EXPECT_STATUS(pkv_attn_check(&a, 1, &err_), PKV_ERR_ARGUMENT, "unpacked");
#undef STORE_FAIL
}

/* Stores T keys after 2 cached tokens (page 2 then page 0) and loads all 7 back: the bytes follow the
 * contract's rule (scale = amax / 448 per 128 channels, codes fp8(x / scale), rope in bf16) and the
 * load gives concat(code * scale, rope). */
static void test_store_load(pkv_kv_format f) {
  const int64_t row = f == PKV_KV_FP8_DS_MLA ? DS_ROW : ROPE_ROW;
  memset(g_pool, 0, sizeof g_pool);
  for (int i = 0; i < T * D; i++) g_key[i] = (float)rnd_normal() * (i % 7 == 0 ? 30.0f : 1.0f);
  for (int c = 128; c < 256; c++) g_key[c] = 0.0f; /* a group of zeros: scale 1 */
  pkv_store_args a = store_call(f), parts[2];
  int n = 0;
  EXPECT_STATUS(pkv_store_unpack(&a, parts, &n, &err_), PKV_OK, "");
  for (int i = 0; i < n; i++) EXPECT_STATUS(pkv_store_check(&parts[i], 1, &err_), PKV_OK, "");
  for (int i = 0; i < n; i++) pkv_store_cpu(&parts[i], 0, pkv_store_cpu_work(&parts[i]));
  const uint8_t *pool = (const uint8_t *)g_pool;
  int bad = 0;
  for (int t = 0; t < T; t++) {
    int64_t pos = 2 + t, page = g_table[pos / P], slot = pos % P;
    const uint8_t *r = pool + (page * P + slot) * row;
    const float *x = g_key + t * D;
    for (int g = 0; g < 4; g++) {
      float amax = 0.0f;
      for (int c = 0; c < 128; c++) amax = fmaxf(amax, fabsf(x[g * 128 + c]));
      float s = f == PKV_KV_FP8_ROPE ? g_scale : pkv_fp8_scale_for(amax, PKV_DTYPE_FP8_E4M3);
      if (f == PKV_KV_FP8_DS_MLA) {
        float stored;
        memcpy(&stored, r + 512 + 4 * g, 4);
        bad += !same_float(stored, s);
      }
      for (int c = 0; c < 128; c++) bad += r[g * 128 + c] != pkv_fp8_quantize(x[g * 128 + c], s, PKV_DTYPE_FP8_E4M3);
    }
    int64_t rope = pkv_kv_format_layout(f)->rope_offset;
    for (int c = 0; c < 64; c++) {
      uint16_t h;
      memcpy(&h, r + rope + 2 * c, 2);
      bad += h != pkv_f32_to_bf16(x[512 + c]);
    }
  }
  CHECK(bad == 0, "%s: %d stored bytes or scales differ from the contract's rule", pkv_kv_format_name(f), bad);

  pkv_load_args l;
  memset(&l, 0, sizeof l);
  static float loaded[(T + 2) * D];
  l.cache = packed_cache(row);
  if (f == PKV_KV_FP8_ROPE) l.scales = T1(&g_scale, PKV_DTYPE_F32, 1);
  l.lookup_table = T2(g_table, PKV_DTYPE_I32, 1, 2);
  l.seq_lens = T1(g_seq, PKV_DTYPE_I32, 1);
  int32_t out_offsets[2] = {0, T + 2};
  l.output_row_offsets = T1(out_offsets, PKV_DTYPE_I32, 2);
  l.out = T3(loaded, PKV_DTYPE_F32, T + 2, 1, D);
  l.quant_group = 128;
  l.kv_format = f;
  pkv_load_args lp[2];
  EXPECT_STATUS(pkv_load_unpack(&l, lp, &n, &err_), PKV_OK, "");
  CHECK(n == 2, "two plain loads");
  float groups[1] = {g_scale};
  for (int i = 0; i < n; i++) {
    EXPECT_STATUS(pkv_load_check(&lp[i], 1, &err_), PKV_OK, "");
    /* the readers' form of the per-tensor scale, as the torch shim passes it */
    if (pkv_scales_per_tensor(&lp[i].scales)) pkv_scales_broadcast(&lp[i].scales, &lp[i].cache, lp[i].quant_group, groups);
  }
  for (int i = 0; i < n; i++) pkv_load_cpu(&lp[i], 0, pkv_load_cpu_work(&lp[i]));
  bad = 0;
  for (int t = 0; t < T; t++) {
    int64_t pos = 2 + t, page = g_table[pos / P], slot = pos % P;
    const uint8_t *r = pool + (page * P + slot) * row;
    for (int c = 0; c < D; c++) {
      float want;
      if (c < 512) {
        float s = g_scale;
        if (f == PKV_KV_FP8_DS_MLA) memcpy(&s, r + 512 + 4 * (c / 128), 4);
        want = pkv_load_f32(r, c, PKV_DTYPE_FP8_E4M3) * s;
      } else {
        uint16_t h;
        memcpy(&h, r + pkv_kv_format_layout(f)->rope_offset + 2 * (c - 512), 2);
        want = pkv_bf16_to_f32(h);
      }
      bad += !same_float(loaded[pos * D + c], want);
    }
  }
  CHECK(bad == 0, "%s: %d loaded values differ from concat(code * scale, rope)", pkv_kv_format_name(f), bad);

  /* the readers' descriptor of the attention call's K (pkv_kv_cache) decodes the same logical keys */
  static float q[T * D], out[T * 512];
  pkv_attn_args at;
  memset(&at, 0, sizeof at);
  at.q = T3(q, PKV_DTYPE_F32, T, 1, D);
  at.out = T3(out, PKV_DTYPE_F32, T, 1, 512);
  at.k_cache = packed_cache(row);
  if (f == PKV_KV_FP8_ROPE) at.k_scales = T1(&g_scale, PKV_DTYPE_F32, 1);
  at.kv_format = f;
  pkv_attn_args plain;
  EXPECT_STATUS(pkv_attn_unpack(&at, &plain, &err_), PKV_OK, "");
  if (pkv_scales_per_tensor(&plain.k_scales)) pkv_scales_broadcast(&plain.k_scales, &plain.k_cache, plain.quant_group, groups);
  pkv_kv_cache kc = pkv_kv_cache_from(&plain.k_cache, &plain.k_scales, plain.quant_group, plain.k_tail_dim,
                                      plain.k_tail_offset);
  CHECK(pkv_kv_dim(&kc) == D && !pkv_kv_scale_per_row(&kc), "%s: 576 key channels, no folded scale (a tail)",
        pkv_kv_format_name(f));
  bad = 0;
  for (int t = 0; t < T; t++) {
    int64_t pos = 2 + t, page = g_table[pos / P], slot = pos % P;
    for (int c = 0; c < D; c++) bad += !same_float(pkv_kv_load(&kc, page, slot, 0, c), loaded[pos * D + c]);
  }
  CHECK(bad == 0, "%s: %d channels of pkv_kv_load differ from paged_load's", pkv_kv_format_name(f), bad);
}

int main(void) {
  test_names();
  test_store_views();
  test_refusals();
  test_store_load(PKV_KV_FP8_DS_MLA);
  test_store_load(PKV_KV_FP8_ROPE);
  return check_report("kv_format");
}
