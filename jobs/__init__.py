"""The job runner: prompt datasets in, Arrow shards out, crash-safe resume.

Entry point: ``python -m jobs generate --dataset PATH --model DIR --output DIR``
(``make generate DATASET=...``). The runner knows nothing about caches or
drafts; it drives `mtp_engine.MTPEngine`.
"""

import mtp_engine  # noqa: F401  (first: it routes MLX's CPU matmuls before anything loads MLX)


def run(config_file: str | None = None, *, engine=None, stream=None, **settings):
    """Run or resume a generation job from Python, with the CLI's settings.

    Args:
        config_file: A YAML or JSON file of settings (``--config``).
        engine: An `mtp_engine.MTPEngine` already loaded for ``model``, to
            run several jobs on one loaded model (default: loaded here).
        stream: Where the job's log goes (default stderr).
        **settings: ``python -m jobs generate`` flags with underscores
            (``dataset=``, ``model=``, ``output=``, ``mode="auto"``,
            ``max_tokens=128``, ...); they override ``config_file``.

    Returns:
        The run's `jobs.runner.JobSummary` (counts, tokens, time).

    Raises:
        jobs.config.ConfigError: An unknown or invalid setting; and the
        errors of `jobs.runner.run_job`.
    """
    from jobs.config import JobConfig, read_config_file
    from jobs.runner import run_job

    config = JobConfig.from_sources(read_config_file(config_file) if config_file else {}, settings)
    return run_job(config, engine=engine, stream=stream)
