"""The job runner: prompt datasets in, Arrow shards out, crash-safe resume.

Entry point: ``python -m jobs generate --dataset PATH --model DIR --output DIR``
(``make generate DATASET=...``). The runner knows nothing about caches or
drafts; it drives `mtp_engine.MTPEngine`.
"""

import mtp_engine  # noqa: F401  (first: it routes MLX's CPU matmuls before anything loads MLX)
