"""(A reliability review: ``STMOE_CACHE=`` put the store packed on first use in the working
directory, ``./stores``.)"""

from __future__ import annotations

from pathlib import Path

from stmoe.util.cache_dir import cache_dir


def test_an_empty_or_unset_stmoe_cache_is_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for value in ("", None):
        if value is None:
            monkeypatch.delenv("STMOE_CACHE", raising=False)
        else:
            monkeypatch.setenv("STMOE_CACHE", value)
        assert cache_dir("stores") == tmp_path / "home" / ".cache" / "stmoe" / "stores"
    monkeypatch.setenv("STMOE_CACHE", str(tmp_path / "mine"))
    assert cache_dir("vllm") == tmp_path / "mine" / "vllm"


def test_every_first_use_folder_is_read_through_it():
    src = Path(__file__).resolve().parents[2] / "src" / "stmoe"
    readers = [p for p in src.rglob("*.py") if '"STMOE_CACHE"' in p.read_text()]
    assert [p.name for p in readers] == ["cache_dir.py"], readers
