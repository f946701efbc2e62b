/*
 * A few-row sgemm for decoding and verify forwards (see cpu_blas.c).
 *
 * A forward over T tokens multiplies T rows (T = 1 in plain decoding, 2 to 8
 * in a verify) by every weight matrix. Row by row, each row streams the whole
 * matrix through the core again; here a tile of up to 8 rows shares every
 * load of the weights, so a verify over 5 tokens costs about 2.7 one-token
 * products instead of 5.
 *
 * Every element of C is computed in one fixed order that depends only on k:
 * LANES partial sums over k (lane l takes k = l, l + LANES, ...), reduced by
 * `lane_sum`, then the k % LANES tail in k order. How rows and columns are
 * tiled never changes it, so row i of a T-row product equals the one-row
 * product of row i bit for bit: per-token captured states of a verify forward equal
 * token-by-token decoding. Build it with -ffp-contract=off: the vector
 * multiply-adds are fused explicitly (MADD) and nothing else is, so no tile
 * rounds differently from another; the tests check rows against one-row
 * products.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#if defined(__FMA__)
#include <immintrin.h>
#endif

#include "few_rows.h"

#if defined(__AVX__)
/* 8 lanes even where AVX-512 exists: on the machines measured (AMD Zen 4,
   which splits 512-bit operations in two) 256-bit vectors were as fast, and
   each output's lane sum is shorter. */
#define LANES 8
#else
#define LANES 4
#endif

#if defined(__AVX512VL__)
/* 32 vector registers: tiles of R rows by WIDE[R] columns hold R * WIDE[R]
   accumulators, R row vectors and one weight vector. */
#define TILE_WIDTHS {0, 8, 8, 6, 4, 4, 3, 3, 2}
#define WIDE_TILES(X) X(1, 8) X(2, 8) X(3, 6) X(4, 4) X(5, 4) X(6, 3) X(7, 3) X(8, 2)
#else
/* 16 vector registers. */
#define TILE_WIDTHS {0, 4, 4, 3, 2, 2, 1, 1, 1}
#define WIDE_TILES(X) X(1, 4) X(2, 4) X(3, 3) X(4, 2) X(5, 2) X(6, 1) X(7, 1) X(8, 1)
#endif

#define MAX_TILE_ROWS 8

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4), may_alias));

static inline vec load(const float *p) { return *(const vec_unaligned *)p; }

/* acc + a * b for every lane: one fused multiply-add where the machine has
   it. Everything else is built with -ffp-contract=off, so no other
   multiply-add is fused in some places and not in others. */
#if defined(__FMA__) && LANES == 8
#define MADD(acc, a, b) ((vec)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(acc)))
#else
#define MADD(acc, a, b) ((acc) + (a) * (b))
#endif

/* Keep v in a register: GCC otherwise re-reads the operand from memory at
   every multiply-add, which doubles the loads of the inner loop. */
#if defined(__AVX512VL__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__x86_64__) || defined(__i386__)
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

/* The sum of a vector's lanes in one fixed order: halves added pairwise
   (lane i + lane i + LANES/2, and so on down to one lane). */
typedef float half_vec __attribute__((vector_size(LANES * sizeof(float) / 2)));
typedef float quarter_vec __attribute__((vector_size(LANES * sizeof(float) / 4)));

static inline float lane_sum(vec v) {
#if LANES == 8
  half_vec h = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  quarter_vec q = __builtin_shufflevector(h, h, 0, 1) + __builtin_shufflevector(h, h, 2, 3);
  return q[0] + q[1];
#else
  half_vec h = __builtin_shufflevector(v, v, 0, 1) + __builtin_shufflevector(v, v, 2, 3);
  return h[0] + h[1];
#endif
}

/* BLAS's C = alpha * dot + beta * C, not reading C when beta is 0. */
static inline float scaled(float dot, float alpha, float beta, const float *c) {
  float v = alpha == 1.0f ? dot : alpha * dot;
  return beta == 0.0f ? v : v + beta * *c;
}

/* Rows 0..R of A (k wide, rows lda apart) times rows 0..J of B (k wide, rows
   ldb apart) into C (rows ldc apart). */
#define DOT_TILE(R, J)                                                                      \
  static void dot_tile_##R##_##J(blasint k, const float *a, blasint lda, const float *b,      \
                                 blasint ldb, float alpha, float beta, float *c, blasint ldc) { \
    vec acc[R][J];                                                                          \
    for (int r = 0; r < R; r++)                                                             \
      for (int q = 0; q < J; q++) acc[r][q] = (vec){0};                                     \
    const blasint kv = k - k % LANES;                                                       \
    for (blasint p = 0; p < kv; p += LANES) {                                               \
      vec av[R];                                                                            \
      for (int r = 0; r < R; r++) {                                                         \
        av[r] = load(a + (size_t)r * lda + p);                                              \
        IN_REGISTER(av[r]);                                                                 \
      }                                                                                     \
      for (int q = 0; q < J; q++) {                                                         \
        vec bv = load(b + (size_t)q * ldb + p);                                             \
        IN_REGISTER(bv);                                                                    \
        for (int r = 0; r < R; r++) acc[r][q] = MADD(acc[r][q], av[r], bv);                    \
      }                                                                                     \
    }                                                                                       \
    for (int r = 0; r < R; r++) {                                                           \
      for (int q = 0; q < J; q++) {                                                         \
        float s = lane_sum(acc[r][q]);                                                      \
        for (blasint p = kv; p < k; p++) s = s + a[(size_t)r * lda + p] * b[(size_t)q * ldb + p]; \
        float *out = c + (size_t)r * ldc + q;                                               \
        *out = scaled(s, alpha, beta, out);                                                 \
      }                                                                                     \
    }                                                                                       \
  }

typedef void (*dot_tile)(blasint, const float *, blasint, const float *, blasint, float, float,
                         float *, blasint);

#define DECLARE(R, J) DOT_TILE(R, J)
#define POINTER(R, J) dot_tile_##R##_##J,
DOT_TILE(1, 1) DOT_TILE(2, 1) DOT_TILE(3, 1) DOT_TILE(4, 1)
DOT_TILE(5, 1) DOT_TILE(6, 1) DOT_TILE(7, 1) DOT_TILE(8, 1)
#if defined(__AVX512VL__)
WIDE_TILES(DECLARE)
#else
DOT_TILE(1, 4) DOT_TILE(2, 4) DOT_TILE(3, 3) DOT_TILE(4, 2) DOT_TILE(5, 2)
#endif
static const dot_tile WIDE_TILE[] = {0, WIDE_TILES(POINTER)};
static const int WIDE[] = TILE_WIDTHS;
static const dot_tile ONE_TILE[] = {0, dot_tile_1_1, dot_tile_2_1, dot_tile_3_1, dot_tile_4_1,
                                    dot_tile_5_1, dot_tile_6_1, dot_tile_7_1, dot_tile_8_1};

/* C = alpha A B^T + beta C with B n x k (a Linear layer's weight). */
static void times_transposed(blasint m, blasint n, blasint k, float alpha, const float *a,
                             blasint lda, const float *b, blasint ldb, float beta, float *c,
                             blasint ldc) {
  for (blasint i = 0; i < m; i += MAX_TILE_ROWS) {
    const int rows = m - i < MAX_TILE_ROWS ? (int)(m - i) : MAX_TILE_ROWS;
    const int wide = WIDE[rows];
    const float *ai = a + (size_t)i * lda;
    float *ci = c + (size_t)i * ldc;
    blasint j = 0;
    for (; j + wide <= n; j += wide)
      WIDE_TILE[rows](k, ai, lda, b + (size_t)j * ldb, ldb, alpha, beta, ci + j, ldc);
    for (; j < n; j++) ONE_TILE[rows](k, ai, lda, b + (size_t)j * ldb, ldb, alpha, beta, ci + j, ldc);
  }
}

/* C = alpha A B + beta C with B k x n: C[i][j] sums a[i][p] * b[p][j] in p
   order, LANES columns at a time (the last columns one by one, in the same
   order). */
static void times_plain(blasint m, blasint n, blasint k, float alpha, const float *a,
                        blasint lda, const float *b, blasint ldb, float beta, float *c,
                        blasint ldc) {
  for (blasint i = 0; i < m; i++) {
    const float *ai = a + (size_t)i * lda;
    float *ci = c + (size_t)i * ldc;
    blasint j = 0;
    for (; j + LANES <= n; j += LANES) {
      vec acc = {0};
      for (blasint p = 0; p < k; p++) acc = MADD(acc, load(b + (size_t)p * ldb + j), (vec){0} + ai[p]);
      float s[LANES];
      memcpy(s, &acc, sizeof s);
      for (int q = 0; q < LANES; q++) ci[j + q] = scaled(s[q], alpha, beta, ci + j + q);
    }
    for (; j < n; j++) {
      float s = 0.0f;
      for (blasint p = 0; p < k; p++) s = s + ai[p] * b[(size_t)p * ldb + j];
      ci[j] = scaled(s, alpha, beta, ci + j);
    }
  }
}

static __thread float *packed = NULL;
static __thread size_t packed_floats = 0;

int mtp_few_rows_sgemm(int trans_a, int trans_b, blasint m, blasint n, blasint k, float alpha,
                       const float *a, blasint lda, const float *b, blasint ldb, float beta,
                       float *c, blasint ldc) {
  if (trans_a != FEW_NO_TRANS) {
    /* op(A) = A^T: copy its rows out contiguously (exact, no arithmetic). */
    const size_t need = (size_t)m * (size_t)k;
    if (need > packed_floats) {
      free(packed);
      packed = malloc(need * sizeof(float));
      packed_floats = packed != NULL ? need : 0;
      if (packed == NULL) return -1;
    }
    for (blasint i = 0; i < m; i++)
      for (blasint p = 0; p < k; p++) packed[(size_t)i * k + p] = a[(size_t)p * lda + i];
    a = packed;
    lda = k;
  }
  if (trans_b == FEW_NO_TRANS) {
    times_plain(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    times_transposed(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  return 0;
}
