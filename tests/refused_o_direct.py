"""A file system that accepts O_DIRECT at open and refuses every read through it (EINVAL),
as some FUSE and sandboxed ones do, for the tests of the readers' fallback to plain reads."""

from __future__ import annotations

import errno
import os

import pytest


def refuse_o_direct_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Patch ``os.open`` (the flag stripped, its fds remembered) and ``os.preadv`` (EINVAL on
    those fds); the paths an O_DIRECT open was tried on, filled as they are tried."""
    direct_fds: set[int] = set()
    tried: list[str] = []
    real_open, real_preadv = os.open, os.preadv

    def fake_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags & ~os.O_DIRECT, *args, **kwargs)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
            tried.append(str(path))
        else:  # (a number a closed O_DIRECT fd had)
            direct_fds.discard(fd)
        return fd

    def fake_preadv(fd, buffers, offset, *args):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "preadv", fake_preadv)
    return tried
