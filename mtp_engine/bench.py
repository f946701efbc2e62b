"""``python -m mtp_engine.bench``: the command of `mtp_engine.tools.bench`."""

from mtp_engine.tools.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
