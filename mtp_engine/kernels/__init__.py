"""Fast paths behind the engine's operations: the CPU extensions' Python side
(built from ``native/`` by ``make install``) and CUDA kernels (sources in
``kernels/cuda/``, read at load). Each module exposes its operation and an
`availability` answer; `mtp_engine.options` says whether it is wanted.
``import mtp_engine`` imports no extension and no CUDA module: those load
when an engine is built on a machine that can run them."""
