"""``python -m mtp_engine.lossless``: the command of `mtp_engine.tools.lossless`."""

from mtp_engine.tools.lossless import main

if __name__ == "__main__":
    raise SystemExit(main())
