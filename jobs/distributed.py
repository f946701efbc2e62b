"""Running a job in one process or across mlx.launch ranks."""

from __future__ import annotations

from jobs.config import JobConfig
from jobs.runner import JobSummary, run_job


def run_distributed_or_local(config: JobConfig) -> JobSummary:
    """Run the job; under ``mlx.launch`` (world size > 1) each rank takes the
    rows whose id hashes to it."""
    import mlx.core as mx

    group = mx.distributed.init()
    world, rank = group.size(), group.rank()
    if world == 1:
        return run_job(config)

    def barrier() -> None:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))

    return run_job(config, rank=rank, world=world, barrier=barrier)
