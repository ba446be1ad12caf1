"""``stmoe.util.warn``: a warning names the first line outside stmoe, however deep in
stmoe it was raised."""

from __future__ import annotations

import inspect
import warnings

from stmoe.util.warn import warn


def test_called_from_outside_it_names_the_calling_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        warn("here", UserWarning)
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]


def test_raised_deep_inside_stmoe_it_names_the_line_that_called_into_stmoe(tmp_path):
    """The pack lock's warning (another pack holds the lock), raised in stmoe's
    ``pack_lock`` under contextlib's ``__enter__``: it names this file's ``with`` line."""
    import fcntl
    import threading

    from stmoe.runtime.store.folder import LOCK_NAME, pack_lock

    (tmp_path / LOCK_NAME).touch()
    with open(tmp_path / LOCK_NAME) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # "another pack", let go of in a moment
        threading.Timer(0.2, fcntl.flock, (held, fcntl.LOCK_UN)).start()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pack_lock(tmp_path):
                line = inspect.currentframe().f_lineno - 1
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]
