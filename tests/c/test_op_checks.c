/* Unit tests of each op's checker in the pagedkv C core (run by tests/c/run.sh under ASan + UBSan).
 *
 * A valid call passes; each broken rule fails with a message of the form "<op>: <argument> ..." and
 * the right status; index-value checks only when asked; integer-overflow edges and negative strides
 * found by the fuzzer. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pkv_numeric.h"
#include "pkv_cpu_ops.h"
#include "check.h"
#include "test_util.h"

/* Runs a checker expecting failure: status, and a message starting "<op>: " that names `arg`. */
#define EXPECT_FAIL(call, status_wanted, op, arg)                                                            \
  do {                                                                                                       \
    pkv_error err_;                                                                                          \
    memset(&err_, 0, sizeof err_);                                                                           \
    pkv_status s_ = (call);                                                                                  \
    CHECK(s_ == (status_wanted), "%s: status %d, expected %d (message: %s)", #call, (int)s_,                  \
          (int)(status_wanted), err_.message);                                                               \
    CHECK(strncmp(err_.message, op ": ", strlen(op) + 2) == 0, "message does not start with \"%s: \": %s", op, \
          err_.message);                                                                                     \
    CHECK(strstr(err_.message, arg) != NULL, "message does not name %s: %s", arg, err_.message);            \
  } while (0)

#define EXPECT_PASS(call)                                                           \
  do {                                                                              \
    pkv_error err_;                                                                 \
    memset(&err_, 0, sizeof err_);                                                  \
    pkv_status s_ = (call);                                                         \
    CHECK(s_ == PKV_OK, "%s failed: %s", #call, err_.message);                      \
  } while (0)

/* ---- a small valid paged_store setup: B = 2, P = 4, Hk = 2, D = 8, N = 6 ---- */
enum { SB = 2, SP = 4, SH = 2, SD = 8, SN = 6, SMAXP = 3, ST = 7 };
static float s_key[ST * SH * SD], s_value[ST * SH * SD];
static float s_kc[SN * SP * SH * SD], s_vc[SN * SP * SH * SD];
static uint8_t s_kq[SN * SP * SH * SD];
static float s_ks[SN * SP * SH * 1];
static int32_t s_offsets[SB + 1] = {0, 3, 7};
static int32_t s_lengths[SB] = {2, 5};
static int32_t s_table[SB * SMAXP] = {4, 1, 9, /* row 1: */ 0, 5, 3};
static int64_t s_int64[16];

static pkv_store_args store_valid(void) {
  pkv_store_args a;
  memset(&a, 0, sizeof a);
  a.key = T3(s_key, PKV_DTYPE_F32, ST, SH, SD);
  a.value = T3(s_value, PKV_DTYPE_F32, ST, SH, SD);
  a.k_cache = T4(s_kc, PKV_DTYPE_F32, SN, SP, SH, SD);
  a.v_cache = T4(s_vc, PKV_DTYPE_F32, SN, SP, SH, SD);
  a.input_row_offsets = T1(s_offsets, PKV_DTYPE_I32, SB + 1);
  a.cache_lengths = T1(s_lengths, PKV_DTYPE_I32, SB);
  a.lookup_table = T2(s_table, PKV_DTYPE_I32, SB, SMAXP);
  a.quant_group = 128;
  return a;
}

static void test_store_check(void) {
  const char *op = "paged_store";
  (void)op;
  pkv_store_args a = store_valid();
  EXPECT_PASS(pkv_store_check(&a, 1, &err_));

#define STORE_FAIL(mutation, status, arg)                      \
  do {                                                         \
    pkv_store_args b = store_valid();                          \
    mutation;                                                  \
    EXPECT_FAIL(pkv_store_check(&b, 1, &err_), status, "paged_store", arg); \
  } while (0)

  STORE_FAIL(b.quant_group = 0, PKV_ERR_ARGUMENT, "quant_group");
  STORE_FAIL(b.k_cache = none(), PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.ndim = 3, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.ndim = 7, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.dtype = PKV_DTYPE_I32, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.dtype = PKV_DTYPE_OTHER, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.sizes[1] = 0, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.sizes[2] = 0, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.sizes[3] = 0, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.strides[3] = 2, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.strides[0] = 0, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.key = none(), PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.key.dtype = PKV_DTYPE_F64, PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.key.dtype = PKV_DTYPE_FP8_E4M3, PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.key.sizes[1] = 3, PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.key.sizes[2] = 4, PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.key.strides[2] = 3, PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.key.device = 0, PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.value = none(), PKV_ERR_ARGUMENT, "value");
  STORE_FAIL(b.v_cache = none(), PKV_ERR_ARGUMENT, "v_cache");
  STORE_FAIL(b.v_cache.sizes[0] = 5, PKV_ERR_ARGUMENT, "v_cache");
  STORE_FAIL(b.v_cache.device = 1, PKV_ERR_ARGUMENT, "v_cache");
  STORE_FAIL(b.value.sizes[0] = 6, PKV_ERR_ARGUMENT, "value");
  STORE_FAIL(b.value.sizes[2] = 7, PKV_ERR_ARGUMENT, "value");
  STORE_FAIL(b.value.dtype = PKV_DTYPE_I64, PKV_ERR_ARGUMENT, "value");
  STORE_FAIL(b.k_scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 1), PKV_ERR_ARGUMENT, "k_scales");
  STORE_FAIL((b.k_cache.data = s_kq, b.k_cache.dtype = PKV_DTYPE_FP8_E4M3), PKV_ERR_ARGUMENT, "k_scales");
  STORE_FAIL((b.k_cache.data = s_kq, b.k_cache.dtype = PKV_DTYPE_FP8_E4M3,
              b.k_scales = T4(s_ks, PKV_DTYPE_F16, SN, SP, SH, 1)), PKV_ERR_ARGUMENT, "k_scales");
  STORE_FAIL((b.k_cache.data = s_kq, b.k_cache.dtype = PKV_DTYPE_FP8_E4M3,
              b.k_scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 2)), PKV_ERR_ARGUMENT, "k_scales");
  STORE_FAIL((b.k_cache.data = s_kq, b.k_cache.dtype = PKV_DTYPE_FP8_E4M3,
              b.k_scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 1), b.k_scales.strides[0] = 0), PKV_ERR_ARGUMENT,
             "k_scales");
  STORE_FAIL((b.value = none(), b.v_cache = none(), b.v_scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 1)),
             PKV_ERR_ARGUMENT, "v_scales");
  STORE_FAIL(b.lookup_table.dtype = PKV_DTYPE_I64, PKV_ERR_ARGUMENT, "lookup_table");
  STORE_FAIL(b.cache_lengths.dtype = PKV_DTYPE_U8, PKV_ERR_ARGUMENT, "cache_lengths");
  STORE_FAIL(b.input_row_offsets.dtype = PKV_DTYPE_I16, PKV_ERR_ARGUMENT, "input_row_offsets");
  STORE_FAIL(b.lookup_table.ndim = 1, PKV_ERR_ARGUMENT, "lookup_table");
  STORE_FAIL(b.lookup_table.sizes[0] = 3, PKV_ERR_ARGUMENT, "lookup_table");
  STORE_FAIL(b.input_row_offsets.sizes[0] = 2, PKV_ERR_ARGUMENT, "input_row_offsets");
  STORE_FAIL(b.lookup_table.device = 0, PKV_ERR_ARGUMENT, "lookup_table");
  /* index values */
  int32_t offsets[SB + 1], lengths[SB], table[SB * SMAXP];
#define WITH_VALUES(stmt, status, arg)                                                     \
  do {                                                                                     \
    memcpy(offsets, s_offsets, sizeof offsets);                                            \
    memcpy(lengths, s_lengths, sizeof lengths);                                            \
    memcpy(table, s_table, sizeof table);                                                  \
    stmt;                                                                                  \
    STORE_FAIL((b.input_row_offsets.data = offsets, b.cache_lengths.data = lengths,        \
                b.lookup_table.data = table), status, arg);                                \
  } while (0)
  WITH_VALUES(offsets[0] = 1, PKV_ERR_INDEX, "input_row_offsets");
  WITH_VALUES(offsets[1] = 8, PKV_ERR_INDEX, "input_row_offsets");
  WITH_VALUES(offsets[2] = 8, PKV_ERR_INDEX, "input_row_offsets"); /* beyond T = 7 */
  WITH_VALUES(lengths[0] = -1, PKV_ERR_INDEX, "cache_lengths");
  WITH_VALUES(lengths[1] = 9, PKV_ERR_INDEX, "cache_lengths"); /* 9 + 4 > 3 pages * 4 */
  WITH_VALUES(lengths[0] = INT32_MAX, PKV_ERR_INDEX, "cache_lengths");
  WITH_VALUES(table[1] = 6, PKV_ERR_INDEX, "lookup_table");  /* row 0 writes positions 2..4: pages 0, 1 */
  WITH_VALUES(table[0] = -1, PKV_ERR_INDEX, "lookup_table");
  WITH_VALUES(table[3 + 2] = INT32_MIN, PKV_ERR_INDEX, "lookup_table");
  /* row 0 writes position 4 = page 1 slot 0; row 1 position 8 = its page 2 slot 0: same slot */
  WITH_VALUES(table[3 + 2] = 1, PKV_ERR_INDEX, "lookup_table");
  /* ... but values are not checked when not asked, and unused entries never are */
  memcpy(table, s_table, sizeof table);
  table[3 + 2] = 1;
  pkv_store_args c = store_valid();
  c.lookup_table.data = table;
  EXPECT_PASS(pkv_store_check(&c, 0, &err_));
  c = store_valid(); /* table[2] = 9 is past row 0's last page: never read */
  EXPECT_PASS(pkv_store_check(&c, 1, &err_));
  /* duplicates that do not collide are fine: row 1 writes page 5 slots 1..3, row 0 page 5 slot 0? no:
   * row 0 writes positions 2, 3 (page 4) and 4 (page 1, slot 0); give row 1's page 0 (positions
   * 0..3, unwritten since it starts at 5) the id 4: read only, no collision */
  memcpy(table, s_table, sizeof table);
  table[3] = 4;
  c.lookup_table.data = table;
  EXPECT_PASS(pkv_store_check(&c, 1, &err_));
  /* empty batch, zero-width table */
  int32_t zero = 0;
  c = store_valid();
  c.input_row_offsets = T1(&zero, PKV_DTYPE_I32, 1);
  c.cache_lengths = T1(NULL, PKV_DTYPE_I32, 0);
  c.lookup_table = T2(NULL, PKV_DTYPE_I32, 0, 0);
  EXPECT_PASS(pkv_store_check(&c, 1, &err_));
  (void)s_int64;
#undef WITH_VALUES
#undef STORE_FAIL
}

/* ---- paged_load ---- */
static float l_out[16 * SH * SD];
static int32_t l_offsets[SB + 1] = {0, 5, 12};
static int32_t l_lens[SB] = {5, 7};

static pkv_load_args load_valid(void) {
  pkv_load_args a;
  memset(&a, 0, sizeof a);
  a.cache = T4(s_kc, PKV_DTYPE_F32, SN, SP, SH, SD);
  a.lookup_table = T2(s_table, PKV_DTYPE_I32, SB, SMAXP);
  a.seq_lens = T1(l_lens, PKV_DTYPE_I32, SB);
  a.output_row_offsets = T1(l_offsets, PKV_DTYPE_I32, SB + 1);
  a.out = T3(l_out, PKV_DTYPE_F32, 16, SH, SD);
  a.quant_group = 128;
  return a;
}

static void test_load_check(void) {
  int32_t table[SB * SMAXP];
  memcpy(table, s_table, sizeof table);
  table[2] = 2; /* row 0 needs 2 pages for 5 tokens: entry 2 still unused */
  pkv_load_args a = load_valid();
  EXPECT_PASS(pkv_load_check(&a, 1, &err_));
#define LOAD_FAIL(mutation, status, arg)                                    \
  do {                                                                      \
    pkv_load_args b = load_valid();                                         \
    mutation;                                                               \
    EXPECT_FAIL(pkv_load_check(&b, 1, &err_), status, "paged_load", arg);   \
  } while (0)
  LOAD_FAIL(b.quant_group = -1, PKV_ERR_ARGUMENT, "quant_group");
  LOAD_FAIL(b.cache.ndim = 5, PKV_ERR_ARGUMENT, "cache");
  LOAD_FAIL(b.cache.dtype = PKV_DTYPE_BOOL, PKV_ERR_ARGUMENT, "cache");
  LOAD_FAIL(b.scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 1), PKV_ERR_ARGUMENT, "scales");
  LOAD_FAIL((b.cache.data = s_kq, b.cache.dtype = PKV_DTYPE_FP8_E5M2), PKV_ERR_ARGUMENT, "scales");
  LOAD_FAIL(b.out = none(), PKV_ERR_ARGUMENT, "out");
  LOAD_FAIL(b.out.dtype = PKV_DTYPE_FP8_E4M3, PKV_ERR_ARGUMENT, "out");
  LOAD_FAIL(b.out.sizes[1] = 1, PKV_ERR_ARGUMENT, "out");
  LOAD_FAIL(b.out.strides[2] = 2, PKV_ERR_ARGUMENT, "out");
  LOAD_FAIL(b.out.strides[0] = 0, PKV_ERR_ARGUMENT, "out");
  LOAD_FAIL(b.out.device = 3, PKV_ERR_ARGUMENT, "out");
  LOAD_FAIL(b.seq_lens.dtype = PKV_DTYPE_I64, PKV_ERR_ARGUMENT, "seq_lens");
  LOAD_FAIL(b.output_row_offsets.sizes[0] = 4, PKV_ERR_ARGUMENT, "output_row_offsets");
  int32_t lens[SB], offsets[SB + 1];
  LOAD_FAIL((memcpy(lens, l_lens, sizeof lens), lens[1] = -3, b.seq_lens.data = lens), PKV_ERR_INDEX, "seq_lens");
  LOAD_FAIL((memcpy(lens, l_lens, sizeof lens), lens[1] = 13, b.seq_lens.data = lens), PKV_ERR_INDEX, "seq_lens");
  LOAD_FAIL((memcpy(lens, l_lens, sizeof lens), lens[0] = 6, b.seq_lens.data = lens), PKV_ERR_INDEX, "seq_lens");
  LOAD_FAIL((memcpy(offsets, l_offsets, sizeof offsets), offsets[2] = 17, b.output_row_offsets.data = offsets),
            PKV_ERR_INDEX, "output_row_offsets");
  LOAD_FAIL((memcpy(offsets, l_offsets, sizeof offsets), offsets[1] = 13, b.output_row_offsets.data = offsets),
            PKV_ERR_INDEX, "output_row_offsets");
  LOAD_FAIL((table[4] = 6, b.lookup_table.data = table), PKV_ERR_INDEX, "lookup_table");
  /* broadcast caches are fine to read */
  pkv_load_args c = load_valid();
  c.cache.strides[0] = 0;
  EXPECT_PASS(pkv_load_check(&c, 1, &err_));
#undef LOAD_FAIL
}

/* ---- flash_attn_paged ---- */
static float a_q[ST * 4 * SD], a_out[ST * 4 * SD];

static pkv_attn_args attn_valid(void) {
  pkv_attn_args a;
  memset(&a, 0, sizeof a);
  a.q = T3(a_q, PKV_DTYPE_F32, ST, 4, SD);
  a.out = T3(a_out, PKV_DTYPE_F32, ST, 4, SD);
  a.input_row_offsets = T1(s_offsets, PKV_DTYPE_I32, SB + 1);
  a.k_cache = T4(s_kc, PKV_DTYPE_F32, SN, SP, SH, SD);
  a.v_cache = T4(s_vc, PKV_DTYPE_F32, SN, SP, SH, SD);
  a.cache_lengths = T1(s_lengths, PKV_DTYPE_I32, SB);
  a.lookup_table = T2(s_table, PKV_DTYPE_I32, SB, SMAXP);
  a.scale = 0.35;
  a.causal = 1;
  a.quant_group = 128;
  a.window_left = -1;
  return a;
}

static void test_attn_check(void) {
  int32_t table[SB * SMAXP] = {4, 1, 2, 0, 5, 3};
  pkv_attn_args a = attn_valid();
  a.lookup_table.data = table;
  EXPECT_PASS(pkv_attn_check(&a, 1, &err_));
#define ATTN_FAIL(mutation, status, arg)                                         \
  do {                                                                           \
    pkv_attn_args b = attn_valid();                                              \
    b.lookup_table.data = table;                                                 \
    mutation;                                                                    \
    EXPECT_FAIL(pkv_attn_check(&b, 1, &err_), status, "flash_attn_paged", arg);  \
  } while (0)
  ATTN_FAIL(b.q.sizes[1] = 3, PKV_ERR_ARGUMENT, "q");
  ATTN_FAIL(b.q.sizes[1] = 0, PKV_ERR_ARGUMENT, "q");
  ATTN_FAIL(b.q.sizes[2] = 4, PKV_ERR_ARGUMENT, "q");
  ATTN_FAIL(b.q.dtype = PKV_DTYPE_F64, PKV_ERR_ARGUMENT, "q");
  ATTN_FAIL(b.q.device = 0, PKV_ERR_ARGUMENT, "q");
  ATTN_FAIL(b.v_cache.sizes[2] = 1, PKV_ERR_ARGUMENT, "v_cache");
  ATTN_FAIL(b.v_cache.dtype = PKV_DTYPE_I8, PKV_ERR_ARGUMENT, "v_cache");
  ATTN_FAIL(b.k_cache.strides[3] = 0, PKV_ERR_ARGUMENT, "k_cache");
  ATTN_FAIL(b.out = none(), PKV_ERR_ARGUMENT, "out");
  ATTN_FAIL(b.out.dtype = PKV_DTYPE_F16, PKV_ERR_ARGUMENT, "out");
  ATTN_FAIL(b.out.sizes[0] = 6, PKV_ERR_ARGUMENT, "out");
  ATTN_FAIL(b.out.strides[1] = 0, PKV_ERR_ARGUMENT, "out");
  ATTN_FAIL(b.window_left = -2, PKV_ERR_ARGUMENT, "window_left");
  ATTN_FAIL(b.softcap = -1, PKV_ERR_ARGUMENT, "softcap");
  ATTN_FAIL(b.softcap = NAN, PKV_ERR_ARGUMENT, "softcap");
  ATTN_FAIL(b.softcap = INFINITY, PKV_ERR_ARGUMENT, "softcap");
  ATTN_FAIL(b.scale = NAN, PKV_ERR_ARGUMENT, "scale");
  ATTN_FAIL(b.scale = -INFINITY, PKV_ERR_ARGUMENT, "scale");
  ATTN_FAIL(b.k_scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 1), PKV_ERR_ARGUMENT, "k_scales");
  ATTN_FAIL(b.cache_lengths.ndim = 2, PKV_ERR_ARGUMENT, "cache_lengths");
  int32_t lengths[SB] = {2, 5};
  ATTN_FAIL((lengths[0] = -5, b.cache_lengths.data = lengths), PKV_ERR_INDEX, "cache_lengths");
  /* row 1 reads pages 0..2 of its row (positions 0..8): a bad id in any of them fails */
  int32_t bad[SB * SMAXP] = {4, 1, 2, 0, -1, 3};
  ATTN_FAIL(b.lookup_table.data = bad, PKV_ERR_INDEX, "lookup_table");
#undef ATTN_FAIL
}

/* Edge values found by the fuzzer: integer overflow in the shared index math and the checks,
 * and descriptors with negative strides (which a framework never makes, a caller could). */
static void test_overflow_edges(void) {
  CHECK(pkv_num_groups(INT64_MAX, 2) == INT64_MAX / 2 + 1, "num_groups(INT64_MAX, 2)");
  CHECK(pkv_num_groups(4, INT64_MAX) == 1, "num_groups(4, INT64_MAX)");
  CHECK(pkv_num_groups(128, 128) == 1 && pkv_num_groups(129, 128) == 2, "num_groups basics");
  CHECK(pkv_pages_for(5, INT64_MAX) == 1 && pkv_pages_for(0, INT64_MAX) == 0, "pages_for with a huge page");
  CHECK(pkv_pages_for(INT64_MAX, 1) == INT64_MAX, "pages_for(INT64_MAX, 1)");
  /* quant_group = INT64_MAX: one scale group per head */
  pkv_store_args a = store_valid();
  a.k_cache.data = s_kq;
  a.k_cache.dtype = PKV_DTYPE_FP8_E4M3;
  a.k_scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 1);
  a.quant_group = INT64_MAX;
  EXPECT_PASS(pkv_store_check(&a, 1, &err_));
  /* a broadcast table of 2^62 columns over a broadcast page of 2^40 tokens: capacity overflows */
  pkv_attn_args b = attn_valid();
  int32_t table[SB] = {2, 3};
  b.lookup_table = tensor_strided(table, PKV_DTYPE_I32, 2, (int64_t[]){SB, (int64_t)1 << 62}, (int64_t[]){1, 0});
  b.k_cache.sizes[1] = b.v_cache.sizes[1] = (int64_t)1 << 40;
  b.k_cache.strides[1] = b.v_cache.strides[1] = 0;
  EXPECT_PASS(pkv_attn_check(&b, 1, &err_));
  /* a broadcast batch of 2^63 - 1 rows: B + 1 offsets cannot be formed, the size check must not overflow */
  b = attn_valid();
  b.cache_lengths = tensor_strided(s_lengths, PKV_DTYPE_I32, 1, (int64_t[]){INT64_MAX}, (int64_t[]){0});
  b.lookup_table = tensor_strided(table, PKV_DTYPE_I32, 2, (int64_t[]){INT64_MAX, SMAXP}, (int64_t[]){0, 1});
  EXPECT_FAIL(pkv_attn_check(&b, 1, &err_), PKV_ERR_ARGUMENT, "flash_attn_paged", "input_row_offsets");
  /* sparse indices over a broadcast cache of 2^62 pages of 2^40 tokens: N * P saturates */
  pkv_sparse_args sp;
  memset(&sp, 0, sizeof sp);
  int32_t listed[ST * 2];
  for (int i = 0; i < ST * 2; i++) listed[i] = i % 3 == 2 ? -1 : INT32_MAX - i;
  sp.q = T3(a_q, PKV_DTYPE_F32, ST, 4, SD);
  sp.out = T3(a_out, PKV_DTYPE_F32, ST, 4, SD);
  sp.k_cache = tensor_strided(s_kc, PKV_DTYPE_F32, 4, (int64_t[]){(int64_t)1 << 62, (int64_t)1 << 40, SH, SD},
                              (int64_t[]){0, 0, SD, 1});
  sp.v_cache = sp.k_cache;
  sp.indices = T3(listed, PKV_DTYPE_I32, ST, 1, 2);
  sp.scale = 0.35;
  sp.quant_group = 128;
  EXPECT_PASS(pkv_sparse_check(&sp, 1, &err_));
  listed[5] = -2;
  EXPECT_FAIL(pkv_sparse_check(&sp, 1, &err_), PKV_ERR_INDEX, "flash_attn_paged_sparse", "indices[2, 0, 1]");
  /* negative strides are rejected by name before any index value is read */
  pkv_store_args c = store_valid();
  c.input_row_offsets.strides[0] = -1;
  EXPECT_FAIL(pkv_store_check(&c, 1, &err_), PKV_ERR_ARGUMENT, "paged_store", "input_row_offsets");
  c = store_valid();
  c.k_cache.strides[0] = -SP * SH * SD;
  EXPECT_FAIL(pkv_store_check(&c, 1, &err_), PKV_ERR_ARGUMENT, "paged_store", "k_cache");
  pkv_load_args d = load_valid();
  d.lookup_table.strides[1] = -1;
  EXPECT_FAIL(pkv_load_check(&d, 1, &err_), PKV_ERR_ARGUMENT, "paged_load", "lookup_table");
  d = load_valid();
  d.out.sizes[0] = -1;
  EXPECT_FAIL(pkv_load_check(&d, 1, &err_), PKV_ERR_ARGUMENT, "paged_load", "out");
  /* a size-1 dim's stride is never used: any value is fine */
  d = load_valid();
  d.out.sizes[1] = 1;
  d.out.strides[1] = -7;
  d.cache.sizes[2] = 1;
  EXPECT_PASS(pkv_load_check(&d, 1, &err_));
}

/* ---- aliasing: written tensors against everything else ---- */

/* 1 when the two views share a byte, by enumerating every element of both (tiny views only). */
static int brute_force_share(const pkv_tensor *a, const pkv_tensor *b, const char *base, size_t bytes) {
  unsigned char *mark = calloc(bytes, 1);
  const pkv_tensor *views[2] = {a, b};
  int shared = 0;
  for (int v = 0; v < 2; v++) {
    const pkv_tensor *t = views[v];
    size_t elem = pkv_dtype_size(t->dtype);
    for (int64_t i0 = 0; i0 < t->sizes[0]; i0++)
      for (int64_t i1 = 0; i1 < t->sizes[1]; i1++)
        for (int64_t i2 = 0; i2 < t->sizes[2]; i2++)
          for (int64_t i3 = 0; i3 < t->sizes[3]; i3++) {
            size_t at = (size_t)((const char *)t->data - base) +
                        elem * (size_t)(i0 * t->strides[0] + i1 * t->strides[1] + i2 * t->strides[2] + i3);
            for (size_t k = 0; k < elem; k++) {
              if (v == 0) mark[at + k] = 1;
              else shared |= mark[at + k];
            }
          }
  }
  free(mark);
  return shared;
}

static void test_aliasing(void) {
  static float buffer[4096];
  int64_t n = 3, l = 2, p = 2, h = 2, d = 4;
  /* the contract's layouts stay legal: collection [N, 2, L, P, Hk, D] (K and V of a layer interleave page
   * by page), FA3 [2, N, P, Hk, D], K and V interleaved per token [N, P, 2, Hk, D] */
  int64_t coll[4] = {2 * l * p * h * d, h * d, d, 1}, tok[4] = {p * 2 * h * d, 2 * h * d, d, 1};
  struct {
    int64_t v_offset;
    const int64_t *strides;
  } legal[] = {{l * p * h * d, coll}, {n * p * h * d, (int64_t[]){p * h * d, h * d, d, 1}}, {h * d, tok}};
  for (size_t i = 0; i < sizeof legal / sizeof legal[0]; i++) {
    for (int64_t layer = 0; layer < l; layer++) {
      pkv_store_args a = store_valid();
      float *k = buffer + (legal[i].strides == coll ? layer * p * h * d : 0);
      a.k_cache = tensor_strided(k, PKV_DTYPE_F32, 4, (int64_t[]){n, p, h, d}, legal[i].strides);
      a.v_cache = tensor_strided(k + legal[i].v_offset, PKV_DTYPE_F32, 4, (int64_t[]){n, p, h, d}, legal[i].strides);
      a.key = T3(s_key, PKV_DTYPE_F32, ST, h, d);
      a.value = T3(s_value, PKV_DTYPE_F32, ST, h, d);
      a.lookup_table = T2(s_table, PKV_DTYPE_I32, SB, SMAXP);
      EXPECT_PASS(pkv_store_check(&a, 0, &err_));
    }
  }

  /* the reported case: v_cache the same tensor as k_cache */
  pkv_store_args b = store_valid();
  b.v_cache = b.k_cache;
  EXPECT_FAIL(pkv_store_check(&b, 0, &err_), PKV_ERR_ARGUMENT, "paged_store", "v_cache overlaps k_cache");
  /* a lookup table that is a view of the cache being written, and the other index tensors */
  b = store_valid();
  b.lookup_table = T2((int32_t *)s_kc + 40, PKV_DTYPE_I32, SB, SMAXP);
  EXPECT_FAIL(pkv_store_check(&b, 0, &err_), PKV_ERR_ARGUMENT, "paged_store", "lookup_table overlaps k_cache");
  b = store_valid();
  b.cache_lengths = T1((int32_t *)s_vc + SN * SP * SH * SD - 1, PKV_DTYPE_I32, SB); /* straddles v_cache's end */
  EXPECT_FAIL(pkv_store_check(&b, 0, &err_), PKV_ERR_ARGUMENT, "paged_store", "cache_lengths overlaps v_cache");
  b = store_valid();
  b.input_row_offsets = T1((int32_t *)s_kc, PKV_DTYPE_I32, SB + 1);
  EXPECT_FAIL(pkv_store_check(&b, 0, &err_), PKV_ERR_ARGUMENT, "paged_store", "input_row_offsets overlaps k_cache");
  /* a table right after the cache's last byte is legal; one element earlier it is not */
  b = store_valid();
  b.k_cache = T4(buffer, PKV_DTYPE_F32, SN, SP, SH, SD);
  b.lookup_table = T2((int32_t *)(buffer + SN * SP * SH * SD), PKV_DTYPE_I32, SB, SMAXP);
  EXPECT_PASS(pkv_store_check(&b, 0, &err_));
  b.lookup_table.data = (int32_t *)b.lookup_table.data - 1;
  EXPECT_FAIL(pkv_store_check(&b, 0, &err_), PKV_ERR_ARGUMENT, "paged_store", "lookup_table overlaps k_cache");

  /* random strided K and V views of one buffer: refused exactly when they share an element */
  int refused = 0, accepted = 0;
  for (int trial = 0; trial < 3000; trial++) {
    int64_t sizes[4] = {1 + (int64_t)(rnd() % 3), 1 + (int64_t)(rnd() % 3), 1 + (int64_t)(rnd() % 2),
                        1 + (int64_t)(rnd() % 4)};
    int64_t ks[4], vs[4];
    for (int i = 0; i < 3; i++) ks[i] = 1 + (int64_t)(rnd() % 40), vs[i] = rnd() % 4 ? ks[i] : 1 + (int64_t)(rnd() % 40);
    ks[3] = vs[3] = 1;
    pkv_store_args a = store_valid();
    a.k_cache = tensor_strided(buffer + rnd() % 200, PKV_DTYPE_F32, 4, sizes, ks);
    a.v_cache = tensor_strided(buffer + rnd() % 200, rnd() % 2 ? PKV_DTYPE_F32 : PKV_DTYPE_BF16, 4, sizes, vs);
    a.key = T3(s_key, PKV_DTYPE_F32, 1, sizes[2], sizes[3]);
    a.value = T3(s_value, PKV_DTYPE_F32, 1, sizes[2], sizes[3]);
    pkv_error err;
    int fails = pkv_store_check(&a, 0, &err) != PKV_OK;
    int shares = brute_force_share(&a.k_cache, &a.v_cache, (const char *)buffer, sizeof buffer);
    CHECK(fails == shares, "trial %d: check %s (%s) but the views %s", trial, fails ? "refused" : "accepted",
          fails ? err.message : "", shares ? "share memory" : "are disjoint");
    if (fails) CHECK(strstr(err.message, "v_cache overlaps k_cache") != NULL, "message: %s", err.message);
    refused += fails, accepted += !fails;
  }
  CHECK(refused > 300 && accepted > 300, "random views: %d refused, %d accepted", refused, accepted);

  /* out and lse of attention, out of paged_load */
  pkv_attn_args c = attn_valid();
  c.out = c.q; /* same shape here: out over q */
  EXPECT_FAIL(pkv_attn_check(&c, 0, &err_), PKV_ERR_ARGUMENT, "flash_attn_paged", "q overlaps out");
  c = attn_valid();
  c.out.data = c.k_cache.data;
  EXPECT_FAIL(pkv_attn_check(&c, 0, &err_), PKV_ERR_ARGUMENT, "flash_attn_paged", "k_cache overlaps out");
  pkv_load_args e = load_valid();
  e.lookup_table.data = (int32_t *)e.out.data + 8;
  EXPECT_FAIL(pkv_load_check(&e, 0, &err_), PKV_ERR_ARGUMENT, "paged_load", "lookup_table overlaps out");
}

/* ---- per-tensor FP8 scales (CONTRACT v1.2): one float32 element, shape [] or [1] ---- */
static void test_per_tensor_scales(void) {
  static float one[1], two[2];
  static double one_f64[1];
  static uint8_t vq[SN * SP * SH * SD];
  one[0] = 0.5f;
  pkv_store_args a = store_valid();
  a.k_cache.data = s_kq, a.k_cache.dtype = PKV_DTYPE_FP8_E4M3;
  a.k_scales = T1(one, PKV_DTYPE_F32, 1);
  EXPECT_PASS(pkv_store_check(&a, 1, &err_));
  a.k_scales.ndim = 0; /* shape [] */
  EXPECT_PASS(pkv_store_check(&a, 1, &err_));
  /* mixed: per-tensor K, per-token V */
  a.v_cache = T4(vq, PKV_DTYPE_FP8_E5M2, SN, SP, SH, SD);
  a.v_scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 1);
  EXPECT_PASS(pkv_store_check(&a, 1, &err_));
  pkv_store_args shared = a; /* K and V may share one per-tensor scale: it is only read */
  shared.v_cache = T4(vq, PKV_DTYPE_FP8_E5M2, SN, SP, SH, SD), shared.v_scales = shared.k_scales;
  EXPECT_PASS(pkv_store_check(&shared, 1, &err_));

#define SCALE_FAIL(mutation, values, arg)                                             \
  do {                                                                                \
    pkv_store_args b = a;                                                             \
    mutation;                                                                         \
    EXPECT_FAIL(pkv_store_check(&b, values, &err_), PKV_ERR_ARGUMENT, "paged_store", arg); \
  } while (0)
  SCALE_FAIL(b.k_scales = T1(two, PKV_DTYPE_F32, 2), 0, "k_scales");
  SCALE_FAIL(b.k_scales = T2(one, PKV_DTYPE_F32, 1, 1), 0, "k_scales");
  SCALE_FAIL(b.k_scales = T1(one_f64, PKV_DTYPE_F64, 1), 0, "k_scales");
  SCALE_FAIL(b.k_scales.device = 0, 0, "k_scales");
  SCALE_FAIL(b.v_scales = T1(two, PKV_DTYPE_F32, 2), 0, "v_scales");
  const float bad[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, -2.0f};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    one[0] = bad[i];
    EXPECT_PASS(pkv_store_check(&a, 0, &err_)); /* the value is checked with the index values */
    SCALE_FAIL((void)0, 1, "k_scales");
    pkv_load_args l = load_valid();
    l.cache.data = s_kq, l.cache.dtype = PKV_DTYPE_FP8_E4M3, l.scales = T1(one, PKV_DTYPE_F32, 1);
    EXPECT_FAIL(pkv_load_check(&l, 1, &err_), PKV_ERR_ARGUMENT, "paged_load", "scales");
  }
  one[0] = FLT_MIN; /* the smallest normal scale is valid */
  EXPECT_PASS(pkv_store_check(&a, 1, &err_));
#undef SCALE_FAIL

  /* the store writes K codes x / s and no scale; V per token as before */
  one[0] = 0.25f;
  float ks_before[SN * SP * SH];
  memcpy(ks_before, s_ks, sizeof ks_before);
  a.v_scales = none(), a.v_cache = T4(s_vc, PKV_DTYPE_F32, SN, SP, SH, SD);
  for (int i = 0; i < ST * SH * SD; i++) s_key[i] = (float)(i % 23) * 9.5f - 100.0f;
  EXPECT_PASS(pkv_store_check(&a, 1, &err_));
  pkv_store_cpu(&a, 0, pkv_store_cpu_work(&a));
  CHECK(one[0] == 0.25f, "the per-tensor scale changed: %g", (double)one[0]);
  CHECK(memcmp(ks_before, s_ks, sizeof ks_before) == 0, "per-token scales written by a per-tensor store");
  /* row 1's first new token (key row 3) sits at position 5: page table[1 * SMAXP + 1] = 5, slot 1 */
  for (int h = 0; h < SH; h++)
    for (int c = 0; c < SD; c++) {
      float x = s_key[(3 * SH + h) * SD + c];
      uint8_t got = s_kq[((5 * SP + 1) * SH + h) * SD + c];
      CHECK(got == pkv_fp8_quantize(x, 0.25f, PKV_DTYPE_FP8_E4M3), "code of %g: 0x%02x", (double)x, got);
    }

  /* the readers' form: [N, P, Hk, ceil(D/G)] with strides 0, 0, 0, 1 over the group copies */
  float groups[3] = {0.25f, 0.25f, 0.25f};
  pkv_tensor k = a.k_cache, s = a.k_scales;
  pkv_scales_broadcast(&s, &k, 3, groups);
  CHECK(s.ndim == 4 && s.sizes[0] == SN && s.sizes[1] == SP && s.sizes[2] == SH && s.sizes[3] == 3,
        "broadcast sizes %lld %lld %lld %lld", (long long)s.sizes[0], (long long)s.sizes[1], (long long)s.sizes[2],
        (long long)s.sizes[3]);
  CHECK(s.strides[0] == 0 && s.strides[1] == 0 && s.strides[2] == 0 && s.strides[3] == 1 && s.data == groups,
        "broadcast strides");
  pkv_attn_args t = attn_valid();
  int32_t table[SB * SMAXP] = {4, 1, 2, 0, 5, 3};
  t.lookup_table.data = table;
  t.k_cache = k, t.k_scales = s, t.quant_group = 3;
  EXPECT_PASS(pkv_attn_check(&t, 1, &err_)); /* a broadcast view of per-token scales is valid to read */
}

int main(void) {
  test_store_check();
  test_load_check();
  test_attn_check();
  test_overflow_edges();
  test_aliasing();
  test_per_tensor_scales();
  return check_report("op checkers");
}
