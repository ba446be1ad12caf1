"""Utilities at the bottom of the tree (no torch): file I/O, progress, units, compilation.

    fileio.py    inputs checked before they are opened, outputs written atomically
    progress.py  progress bars on long work
    units.py     sizes, durations and the capacity grammar ("8", "50%", "64MB")
    jit.py       numba's ``njit`` with the project's settings
"""
