"""stmoe.util.cgroup: the memory bound that --memory's test and the benchmarks hold a process to."""

from __future__ import annotations

from pathlib import Path

import pytest

from stmoe.util import cgroup


def test_a_v2_cgroup_is_made_read_and_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    monkeypatch.setattr(cgroup, "CGROUP_V2", tmp_path)
    group = cgroup.make_cgroup("bound", 1 << 30)
    assert group == tmp_path / "bound"
    assert (group / "memory.max").read_text() == str(1 << 30)
    assert cgroup.cgroup_peak(group) is None  # the kernel has not said
    (group / "memory.peak").write_text("12345\n")
    assert cgroup.cgroup_peak(group) == 12345
    (group / "memory.max").unlink()
    (group / "memory.peak").unlink()
    cgroup.remove_cgroup(group)
    assert not group.exists()


def test_no_cgroup_file_system_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cgroup, "CGROUP_V2", tmp_path / "absent")
    monkeypatch.setattr(cgroup, "CGROUP_V1", tmp_path / "absent" / "memory")
    assert cgroup.make_cgroup("bound", 1 << 30) is None
