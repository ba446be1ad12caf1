"""Utilities at the bottom of the tree (no torch): file I/O, progress, units, config names,
memory bounds, compilation.

    fileio.py        inputs checked before they are opened, outputs written atomically
    progress.py      progress bars on long work
    units.py         sizes, durations, and a capacity ("8", "50%", "64MB") parsed and
                     bounds-checked
    config_names.py  the names transformers' MoE configs give their expert count and top-k
    cgroup.py        a memory bound on a whole process (a memory cgroup), page cache included
    jit.py           numba's ``njit`` with the project's settings
"""
