"""An exclusive lock on a job's output folder, held for the whole job.

An advisory ``flock`` on ``DIR/.lock``: the operating system releases it when
the process dies, so a ``kill -9`` never leaves a stale lock. The file names
the holder (pid, host, start time, job token) so a second job can say who
holds the folder. Under ``mlx.launch`` rank 0 holds the lock and the other
ranks of the same job check that it is held with their job's token
(`FolderLock.check_shared`).

A network file system without lock support makes the lock fail loudly
(``ENOLCK``); two hosts writing one folder over such a file system are not
protected (README, "Crash safety and resume").
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

import orjson

from jobs.ledger import open_fd

LOCK_FILE = ".lock"


class FolderInUse(RuntimeError):
    """Another job holds the output folder."""


class FolderLock:
    """The lock of one output folder."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.path = folder / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, token: str) -> None:
        """Take the lock or raise `FolderInUse` naming the holder."""
        fd = open_fd(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderInUse(f"{self.folder} is in use by another job ({self.describe_holder()}); "
                              "wait for it to finish, or write to another --output") from None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise OSError(e.errno, f"cannot lock {self.path}: the file system does not support locks "
                              f"({e.strerror})", str(self.path)) from None
            raise
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "token": token}
        os.ftruncate(fd, 0)
        os.pwrite(fd, orjson.dumps(holder), 0)
        os.fsync(fd)
        self._fd = fd

    def holder(self) -> dict:
        """What the lock file says about its holder ({} when unreadable)."""
        try:
            data = orjson.loads(self.path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return {}
        return data if isinstance(data, dict) else {}

    def describe_holder(self) -> str:
        h = self.holder()
        if not h:
            return "holder unknown"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("since", 0)))
        return f"pid {h.get('pid')} on host {h.get('host')}, since {since}"

    def is_held(self) -> bool:
        """Whether some process holds the lock now."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def check_shared(self, token: str) -> None:
        """For the ranks of a job whose rank 0 holds the lock: raise
        `FolderInUse` unless the lock is held with ``token``."""
        holder = self.holder()
        if not self.is_held() or holder.get("token") != token:
            raise FolderInUse(f"{self.folder} is not held by this job's rank 0 ({self.describe_holder()})")

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
