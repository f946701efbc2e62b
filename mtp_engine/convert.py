"""``python -m mtp_engine.convert``: the command of `mtp_engine.io.convert`."""

from mtp_engine.io.convert import main

if __name__ == "__main__":
    raise SystemExit(main())
