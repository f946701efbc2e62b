"""The suite itself runs on the CPU BLAS route wherever it is built (the
root conftest imports mtp_engine before MLX)."""

from __future__ import annotations

import pytest

from mtp_engine.kernels import cpu_blas


@pytest.mark.skipif(not cpu_blas.library_path().exists(), reason="the CPU BLAS route is not built")
def test_the_suite_runs_on_the_cpu_blas_route():
    assert cpu_blas.unavailable_reason() is None
    assert cpu_blas.active() == cpu_blas.OPENBLAS
