/* A few-row row-major sgemm (native/few_rows.c). */
#ifndef MTP_FEW_ROWS_H
#define MTP_FEW_ROWS_H

typedef int blasint;

enum { FEW_NO_TRANS = 111 };

/* Row-major C (m x n) = alpha op(A) op(B) + beta C, op given by CBLAS's
   transpose codes (111: as stored, otherwise transposed). Meant for few rows
   (m up to a few dozen). Returns 0, or -1 (nothing written) when it could
   not allocate its buffer. */
int mtp_few_rows_sgemm(int trans_a, int trans_b, blasint m, blasint n, blasint k, float alpha,
                       const float *a, blasint lda, const float *b, blasint ldb, float beta,
                       float *c, blasint ldc);

#endif
