/* pagedkv CPU backend: the CPU kernels' ISA table (internal to csrc/cpu).
 *
 * kernels/pkv_cpu_kernels.inc is compiled once per ISA (isa/pkv_cpu_scalar.c,
 * pkv_cpu_avx2.c, pkv_cpu_avx512.c, each with its own compiler flags) into
 * one pkv_cpu_kernels table. pkv_cpu_kernels_get() picks the table once, from
 * cpuid, or from PAGEDKV_CPU_ISA=scalar|avx2|avx512 when set (a request the
 * CPU cannot run falls back to the best it can). The op drivers
 * (flash_attn_paged.c, paged_store.c, paged_load.c) stay ISA-free and call through the table. */
#ifndef PKV_CPU_H
#define PKV_CPU_H

#include "pkv_cpu_ops.h"
#include "../core/pkv_settings.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Keys per K/V tile: a 64-key tile of K (D <= 128, f32) is 32 KiB and stays in
 * L1/L2 while every query vector of a work item is scored against it. */
#define PKV_CPU_KEYS_PER_TILE 64
/* Keys per tile where decode reads the rows in place (direct and dot decode): the tile ahead,
 * prefetched while this one is computed, is 32 keys of all the item's heads (128 KiB of bf16 K/V
 * at 8 heads of 128), not 64. A multiple of 32 (the softmax takes two 16-lane vectors at a time)
 * dividing KEYS_PER_TILE (tile sizes tried: benchmarks/README.md, "Tried and not kept"). */
#define PKV_CPU_DECODE_KEYS 32
/* Row-pointer slots per work item: the tile in use and the tiles ahead that
 * are being prefetched (tile_rows.inc, attn_common.inc's tile walk). */
#define PKV_CPU_TILE_SLOTS 2
/* Tiles per PV product on the AMX prefill path (attn_amx.inc) */
#define PKV_CPU_PV_TILES 2
/* Widest vector in floats; scratch rows are padded to it so every ISA fits. */
#define PKV_CPU_MAX_LANES 16

PKV_HD int64_t pkv_cpu_pad(int64_t n) { return (n + PKV_CPU_MAX_LANES - 1) / PKV_CPU_MAX_LANES * PKV_CPU_MAX_LANES; }

/* 32-bit words per query row of the FP8 dot decode's q layout (scratch qp, dot_pair_q): the d / 2
 * words of the halves of every 32-element chunk, then chunk 0's 16 again. */
PKV_HD int64_t pkv_cpu_pair_q_words(int64_t d) { return pkv_cpu_pad((d + 1) / 2) + 16; }

/* 1 when FP8 rows of `row` channels with one scale per `group` take exact bf16 dot products: one scale
 * per row (folded into the scores or the probabilities), or per group of a multiple of 32 channels
 * (each group's products summed apart: decode_dot.inc's dot_qk_fp8_groups and dot_pv_fp8_groups). */
PKV_HD int pkv_cpu_fp8_dot_groups_ok(int64_t row, int64_t group) {
  return group >= row || (group > 0 && group % 32 == 0);
}

/* Query-vector arrays (q, qw, s, acc, pb, m, l) hold nqa = nq rounded up to
 * 32 rows, so the AMX path can pad its tiles with zero rows.
 * Per-thread attention scratch, allocated once per work range (never in the
 * hot loop). nq = query vectors of one item (rows x heads per KV head). */
typedef struct {
  int64_t nq, d, dv;   /* capacity */
  float *q;            /* [nq, pad(d)] query vectors, float32, unscaled */
  uint32_t *qw;        /* [nq, pad(d/2)] the same as bf16 pairs (dot-product path) */
  uint32_t *qp;        /* [nq, pkv_cpu_pair_q_words(d)] the same in dot_pair_q's layout (FP8 dot decode) */
  uint32_t *kt;        /* [pad(d), KEYS] packed K tile: float32 or bf16 pairs, key index fastest */
  uint32_t *krow;      /* [KEYS, pad(d)] K rows converted before packing */
  float *vt;           /* [KEYS, pad(dv)] V tile, float32 */
  float *s;            /* [nq, KEYS] scores, then probabilities */
  float *acc;          /* [nq, pad(dv)] unnormalised output */
  float *m, *l;        /* [nq] running max (natural units) and sum */
  float *lv;           /* [nq, MAX_LANES] the sums per vector lane while the tiles run (reduced once) */
  float *kscale, *vscale;                  /* [nq, KEYS] per-key FP8 scales folded into scores / probabilities:
                                            * row 0, or one row per KV head of the item (direct decode) */
  const void **kptr, **vptr;               /* [TILE_SLOTS, KEYS] row pointers of this tile and those ahead */
  const float **ksptr, **vsptr;            /* [TILE_SLOTS, KEYS] scale rows (FP8) */
  uint32_t *zero;                          /* [pad(d)] a zero row for padding keys */
  uint16_t *pb;                            /* [nqa, PV_TILES * KEYS] probabilities as bf16 (AMX) */
  uint32_t *vb;                            /* [PV_TILES * KEYS/2, pad(dv)] V tiles as bf16 key pairs (AMX) */
  uint32_t *qt;                            /* [nqa, pad(d/2)] Q^T per KV head, bf16 pairs (AMX decode) */
  uint32_t *qa;                            /* [pad(d/2), nqa + 16] Q^T of all heads, word-major (AMX decode) */
  float *sk;                               /* [nqa, KEYS] scores as [KV head][key][query] (AMX decode) */
} pkv_cpu_attn_scratch;

/* A thread's items after the one it runs (flash_attn_paged.c's run_items): the rest of a fixed range, or
 * those it claims from the plan's counter. The kernel takes the next one ahead during an item's last tile
 * to prefetch that item's first tile (each item's first tile was otherwise read on demand); run_items
 * then runs it: a claimed item is the thread's from the moment it is taken. */
typedef struct {
  const pkv_attn_item *items;
  void *claims;          /* the plan's atomic counter (pkv_attn_cpu_claim); NULL: a fixed range */
  int64_t next, end;     /* the range's next item; items from end on do not exist */
  int64_t ahead;         /* the item taken ahead, -1 if none */
} pkv_item_queue;

/* The next item, taken now and run next by run_items (NULL when none is left). */
const pkv_attn_item *pkv_item_queue_take_ahead(pkv_item_queue *q);

/* How an attention item runs (pkv_attn_item.path): chosen once per item by the plan, through the table's
 * attn_path (kernels/attn_path.inc), from the table's ISA, the dtypes and shapes and the cpu_decode
 * setting. kernels/attn_item.inc runs each path's function; docs/cpu_kernels.md describes them. */
typedef enum {
  PKV_CPU_PATH_PACKED_F32 = 0, /* packed tiles, float32 words and FMAs (every table) */
  PKV_CPU_PATH_PACKED_BF16,    /* packed tiles, QK on bf16 pairs (AVX512-BF16), PV in float32 */
  PKV_CPU_PATH_PACKED_DOT,     /* packed tiles, QK and PV on bf16 pairs (AVX512-BF16) */
  PKV_CPU_PATH_DIRECT,         /* decode, rows widened in registers, float32 FMAs (AVX2, AVX-512) */
  PKV_CPU_PATH_DOT,            /* decode, rows in place, bf16 dot products (AVX512-BF16) */
  PKV_CPU_PATH_AMX,            /* AMX tiles, prefill (one KV head, >= 16 query vectors) */
  PKV_CPU_PATH_AMX_DECODE,     /* AMX tiles, decode (S^T = K . Q^T) */
} pkv_cpu_attn_path;

typedef struct {
  const char *name;
  /* The path of an item of nqh query vectors per KV head and nh KV heads (pkv_cpu_attn_path). use_dot_bf16:
   * bf16 dot products are allowed (the CPU has them and q and K are exact in bf16); decode: the decode
   * paths allowed (pkv_settings.cpu_decode); scratch_queries: the query vectors the scratch holds
   * (pkv_cpu_attn_scratch.nq), which the dot decode's FP8 scale groups must fit. */
  pkv_cpu_attn_path (*attn_path)(const pkv_attn_args *a, int64_t nqh, int64_t nh, int use_dot_bf16,
                                 pkv_cpu_decode decode, int64_t scratch_queries);
  /* Attention of one plan item over its keys, on its path (it->path, from this table's attn_path). When
   * write_out, normalises and writes the item's rows of a->out; otherwise leaves m, l, acc in w for the
   * split-KV merge. queue: the thread's items after this one (NULL: none); the kernel may take the next
   * during this item's last tile, to prefetch its first (pkv_item_queue_take_ahead). */
  void (*attn_item)(const pkv_attn_args *a, const pkv_attn_item *it, pkv_item_queue *queue, int write_out,
                    pkv_cpu_attn_scratch *w);
  /* Convert n elements src (f32/f16/bf16) into dst of a cache dtype. For FP8,
   * per group of `group` elements: scale = amax / FP8_MAX (1 when amax == 0),
   * written to scales[g], and the quantized codes (bit-exact with
   * pkv_fp8_quantize). */
  void (*store_vec)(const void *src, pkv_dtype src_dtype, int64_t n, void *dst, pkv_dtype dst_dtype, float *scales,
                    int64_t group);
  /* Quantize n elements src (f32/f16/bf16) into FP8 dst with one given scale (a per-tensor scale):
   * fp8(clamp(x / scale, -FP8_MAX, FP8_MAX)), bit-exact with pkv_fp8_quantize; no scale is written. */
  void (*store_vec_scaled)(const void *src, pkv_dtype src_dtype, int64_t n, uint8_t *dst, pkv_dtype dst_dtype,
                           float scale);
  /* Convert n elements of a cache dtype into dst (f32/f16/bf16); FP8 values are
   * multiplied by scales[i / group] (bit-exact with the scalar rule). */
  void (*load_vec)(const void *src, pkv_dtype src_dtype, const float *scales, int64_t group, int64_t n, void *dst,
                   pkv_dtype dst_dtype);
} pkv_cpu_kernels;

extern const pkv_cpu_kernels pkv_cpu_kernels_scalar;
extern const pkv_cpu_kernels pkv_cpu_kernels_avx2;
extern const pkv_cpu_kernels pkv_cpu_kernels_avx512;
extern const pkv_cpu_kernels pkv_cpu_kernels_amx;

/* End of one query vector's softmax (row `row`, query head `head`): applies the sink of a->sinks,
 * writes a->lse when defined, and returns the factor of its accumulator. m is the running max in
 * log2 units, l the sum of 2^(x - m) (pkv_softmax_finish). */
float pkv_attn_cpu_finish_row(const pkv_attn_args *a, int64_t row, int64_t head, float m, float l);

/* The table for this process (chosen once; thread-safe). */
const pkv_cpu_kernels *pkv_cpu_kernels_get(void);
/* 1 when the chosen table is AVX-512 and the CPU has AVX512_BF16 dot products. */
int pkv_cpu_has_dot_bf16(void);
/* 1 when the chosen kernels may use AVX512_VBMI byte permutes (AVX-512 and AMX builds). */
int pkv_cpu_has_vbmi(void);

#ifdef __cplusplus
}
#endif
#endif /* PKV_CPU_H */
