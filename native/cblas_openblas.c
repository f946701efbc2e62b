/*
 * MLX's Linux CPU wheel (mlx[cpu]) links the reference (netlib) BLAS, whose
 * sgemm runs at a few GFLOP/s. This library exports the one BLAS entry point
 * MLX's CPU matmul calls, cblas_sgemm, and forwards it to OpenBLAS as built
 * by the scipy-openblas32 wheel (whose symbols carry a "scipy_" prefix).
 * Loaded with LD_PRELOAD it takes precedence over the bundled BLAS; nothing
 * else in MLX changes. See README, "Faster CPU matmuls".
 *
 * Few rows (decoding, verify forwards, small batches): up to MTP_GEMV_ROWS
 * rows (default 32) are computed one row at a time with sgemv. OpenBLAS's
 * sgemm packs the whole weight matrix on every call, which for a few rows
 * costs more than the arithmetic; row by row, a forward over T tokens also
 * rounds every row exactly as a forward over that one token does, so
 * per-token checkpoints equal token-by-token decoding bit for bit. More rows
 * (prefill) go to sgemm.
 *
 * OpenBLAS runs single-threaded unless OPENBLAS_NUM_THREADS says otherwise:
 * MLX already keeps the cores busy, and OpenBLAS threads on top of it slowed
 * decoding down on the 2-core machine this was measured on.
 */
#include <stdlib.h>
#include <string.h>

typedef int blasint;

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

void scipy_cblas_sgemm(int order, int trans_a, int trans_b, blasint m, blasint n, blasint k,
                       float alpha, const float *a, blasint lda, const float *b, blasint ldb,
                       float beta, float *c, blasint ldc);
void scipy_cblas_sgemv(int order, int trans, blasint m, blasint n, float alpha, const float *a,
                       blasint lda, const float *x, blasint incx, float beta, float *y,
                       blasint incy);
void scipy_openblas_set_num_threads(int n);

static blasint gemv_rows = 32;

__attribute__((constructor)) static void configure(void) {
  if (getenv("OPENBLAS_NUM_THREADS") == NULL) {
    scipy_openblas_set_num_threads(1);
  }
  const char *rows = getenv("MTP_GEMV_ROWS");
  if (rows != NULL && *rows != '\0') {
    gemv_rows = (blasint)atoi(rows);
  }
}

/* Rows at most this many go row by row (0 turns the row path off). */
int mtp_cblas_gemv_rows(void) { return (int)gemv_rows; }

void cblas_sgemm(int order, int trans_a, int trans_b, blasint m, blasint n, blasint k,
                 float alpha, const float *a, blasint lda, const float *b, blasint ldb,
                 float beta, float *c, blasint ldc) {
  if (order != ROW_MAJOR || m > gemv_rows) {
    scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  /* Row i of C = alpha * (row i of op(A)) * op(B) + beta * (row i of C). */
  for (blasint i = 0; i < m; i++) {
    const float *x = trans_a == NO_TRANS ? a + (size_t)i * lda : a + i;
    const blasint incx = trans_a == NO_TRANS ? 1 : lda;
    float *y = c + (size_t)i * ldc;
    if (beta == 0.0f) {
      /* BLAS must not read C when beta is 0; it may hold garbage (NaN). */
      memset(y, 0, sizeof(float) * (size_t)n);
    }
    if (trans_b == NO_TRANS) {
      /* B is k x n: y = B^T x. */
      scipy_cblas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, x, incx, beta, y, 1);
    } else {
      /* B holds op(B)^T, n x k (a Linear layer's weight): y = B x. */
      scipy_cblas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, x, incx, beta, y, 1);
    }
  }
}
