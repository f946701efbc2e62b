"""Running a job in one process or across mlx.launch ranks."""

from __future__ import annotations

import mlx.core as mx

from jobs.config import JobConfig
from jobs.runner import JobSummary, Ranks, run_job


def run_distributed_or_local(config: JobConfig) -> JobSummary:
    """Run the job; under ``mlx.launch`` (world size > 1) each rank takes the
    rows whose id hashes to it."""
    group = mx.distributed.init()
    world, rank = group.size(), group.rank()
    if world == 1:
        return run_job(config)

    def share(value: int) -> int:
        """Rank 0's ``value`` on every rank (a sum where the others add 0);
        it also waits for every rank, like a barrier."""
        mine = value if rank == 0 else 0
        return int(mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=group).item())

    return run_job(config, ranks=Ranks(rank, world, share))
