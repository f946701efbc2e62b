/*
 * MLX's Linux CPU wheel (mlx[cpu]) links the reference (netlib) BLAS, whose
 * sgemm runs at a few GFLOP/s. This library exports the one BLAS entry point
 * MLX's CPU matmul calls, cblas_sgemm, and forwards it to OpenBLAS as built
 * by the scipy-openblas32 wheel (whose symbols carry a "scipy_" prefix).
 * Loaded with LD_PRELOAD it takes precedence over the bundled BLAS; nothing
 * else in MLX changes. See README, "Faster CPU matmuls".
 *
 * Few rows (decoding, verify forwards, small batches): up to MTP_FEW_ROWS
 * rows (default 32) go to native/few_rows.c, which shares every load of the
 * weights among the rows, where OpenBLAS's sgemm would pack the whole weight
 * matrix on every call. It also rounds every row of a T-row product exactly
 * as a one-row product, so per-token checkpoints equal token-by-token
 * decoding bit for bit. More rows (prefill) go to OpenBLAS's sgemm.
 *
 * OpenBLAS runs single-threaded unless OPENBLAS_NUM_THREADS says otherwise:
 * MLX already keeps the cores busy, and OpenBLAS threads on top of it slowed
 * decoding down on the 2-core machine this was measured on.
 */
#include <stdlib.h>

#include "few_rows.h"

enum { ROW_MAJOR = 101 };

void scipy_cblas_sgemm(int order, int trans_a, int trans_b, blasint m, blasint n, blasint k,
                       float alpha, const float *a, blasint lda, const float *b, blasint ldb,
                       float beta, float *c, blasint ldc);
void scipy_openblas_set_num_threads(int n);

static blasint few_rows = 32;

__attribute__((constructor)) static void configure(void) {
  if (getenv("OPENBLAS_NUM_THREADS") == NULL) {
    scipy_openblas_set_num_threads(1);
  }
  const char *rows = getenv("MTP_FEW_ROWS");
  if (rows != NULL && *rows != '\0') {
    few_rows = (blasint)atoi(rows);
  }
}

/* Products of at most this many rows go to the few-row kernel (0: none do). */
int mtp_cblas_few_rows(void) { return (int)few_rows; }

void cblas_sgemm(int order, int trans_a, int trans_b, blasint m, blasint n, blasint k,
                 float alpha, const float *a, blasint lda, const float *b, blasint ldb,
                 float beta, float *c, blasint ldc) {
  if (order == ROW_MAJOR && m <= few_rows &&
      mtp_few_rows_sgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) == 0) {
    return;
  }
  scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
