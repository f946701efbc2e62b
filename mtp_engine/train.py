"""``python -m mtp_engine.train``: the command of `mtp_engine.tools.train`."""

from mtp_engine.tools.train.__main__ import main

if __name__ == "__main__":
    raise SystemExit(main())
