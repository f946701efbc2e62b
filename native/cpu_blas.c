/*
 * MLX's Linux CPU wheel (mlx[cpu]) links the reference (netlib) BLAS, whose
 * sgemm runs at a few GFLOP/s. This library defines the one BLAS entry point
 * MLX's CPU matmul calls, cblas_sgemm. `mtp_engine.kernels.cpu_blas` loads it
 * into the process's global symbol scope before MLX is imported, so MLX's
 * libmlx.so binds its cblas_sgemm here; nothing else in MLX changes.
 *
 * Routes, switchable at run time (mtp_cpu_blas_set_route):
 * - few rows (decoding, verify forwards, small batches): up to `few_rows`
 *   rows go to native/few_rows.c, which shares every load of the weights
 *   among the rows and rounds every row of a T-row product exactly as a
 *   one-row product, so per-token captured states equal token-by-token
 *   decoding bit for bit;
 * - more rows (prefill): OpenBLAS's sgemm, from the scipy-openblas32 wheel
 *   (its symbols carry a "scipy_" prefix);
 * - route 0: the reference BLAS MLX bundles (its cblas_sgemm, looked up in
 *   the library file Python passes to mtp_cpu_blas_set_reference).
 *
 * OpenBLAS runs single-threaded unless OPENBLAS_NUM_THREADS says otherwise.
 * MLX's CPU stream runs on one core, so the second core of a 2-core machine
 * idles while decoding, but 2 OpenBLAS threads (and, tried once, the few-row
 * kernel's columns split over 2 threads: +3-5%) moved batched decoding by
 * no more than this machine's noise: a decoding step is mostly per-op cost.
 */
#include <dlfcn.h>
#include <stdlib.h>

#include "few_rows.h"

enum { ROW_MAJOR = 101 };

typedef void (*sgemm_fn)(int, int, int, blasint, blasint, blasint, float, const float *, blasint,
                         const float *, blasint, float, float *, blasint);

void scipy_cblas_sgemm(int order, int trans_a, int trans_b, blasint m, blasint n, blasint k,
                       float alpha, const float *a, blasint lda, const float *b, blasint ldb,
                       float beta, float *c, blasint ldc);
void scipy_openblas_set_num_threads(int n);

static int route = 1;
static blasint few_rows = 32;
static long long calls = 0;
static sgemm_fn reference = NULL;

__attribute__((constructor)) static void configure(void) {
  if (getenv("OPENBLAS_NUM_THREADS") == NULL) {
    scipy_openblas_set_num_threads(1);
  }
}

/* Route 1: few-row kernel and OpenBLAS; 0: the bundled reference BLAS (needs
   mtp_cpu_blas_set_reference first). `rows`: the few-row kernel's limit (0: off).
   Returns 0, or -1 (nothing changed) for route 0 without a reference. */
int mtp_cpu_blas_set_route(int new_route, int rows) {
  if (new_route == 0 && reference == NULL) return -1;
  route = new_route;
  few_rows = (blasint)rows;
  return 0;
}

/* Find cblas_sgemm in the (already loaded) bundled BLAS at `path`. */
int mtp_cpu_blas_set_reference(const char *path) {
  void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (handle == NULL) handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == NULL) return -1;
  reference = (sgemm_fn)dlsym(handle, "cblas_sgemm");
  return reference == NULL ? -1 : 0;
}

int mtp_cpu_blas_route(void) { return route; }
int mtp_cpu_blas_few_rows(void) { return (int)few_rows; }
/* sgemm calls served here since the library was loaded (the route check). */
long long mtp_cpu_blas_calls(void) { return calls; }

void cblas_sgemm(int order, int trans_a, int trans_b, blasint m, blasint n, blasint k,
                 float alpha, const float *a, blasint lda, const float *b, blasint ldb,
                 float beta, float *c, blasint ldc) {
  __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
  if (route == 0) {
    reference(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  if (order == ROW_MAJOR && m <= few_rows &&
      mtp_few_rows_sgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) == 0) {
    return;
  }
  scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
