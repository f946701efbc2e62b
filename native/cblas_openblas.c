/*
 * MLX's Linux CPU wheel (mlx[cpu]) links the reference (netlib) BLAS, whose
 * sgemm runs at a few GFLOP/s. This library exports the one BLAS entry point
 * MLX's CPU matmul calls, cblas_sgemm, and forwards it to OpenBLAS as built
 * by the scipy-openblas32 wheel (whose symbols carry a "scipy_" prefix).
 * Loaded with LD_PRELOAD it takes precedence over the bundled BLAS; nothing
 * else in MLX changes. See README, "Faster CPU matmuls".
 *
 * OpenBLAS runs single-threaded unless OPENBLAS_NUM_THREADS says otherwise:
 * MLX already keeps the cores busy, and OpenBLAS threads on top of it slowed
 * decoding down on the 2-core machine this was measured on.
 */
#include <stdlib.h>

typedef int blasint;

void scipy_cblas_sgemm(int order, int trans_a, int trans_b, blasint m, blasint n, blasint k,
                       float alpha, const float *a, blasint lda, const float *b, blasint ldb,
                       float beta, float *c, blasint ldc);
void scipy_openblas_set_num_threads(int n);

__attribute__((constructor)) static void one_thread_unless_asked(void) {
  if (getenv("OPENBLAS_NUM_THREADS") == NULL) {
    scipy_openblas_set_num_threads(1);
  }
}

void cblas_sgemm(int order, int trans_a, int trans_b, blasint m, blasint n, blasint k,
                 float alpha, const float *a, blasint lda, const float *b, blasint ldb,
                 float beta, float *c, blasint ldc) {
  scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
