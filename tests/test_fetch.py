"""provision fetch's pure parts: the listing, and what changed locally. The transfer itself
runs on sandbox hosts (tests/integration/test_ux.py)."""

from __future__ import annotations

import os

from provision.run.fetch import Remote, changed, parse_listing


def test_listing_survives_odd_names():
    out = b"model/a.pt\x0012\x001700000000.5\x00odd\nname\x003\x001700000001.0\x00"
    assert parse_listing(out) == [Remote("model/a.pt", 12, 1700000000), Remote("odd\nname", 3, 1700000001)]
    assert parse_listing(b"") == []


def test_only_what_differs_in_size_or_time(tmp_path):
    (tmp_path / "model").mkdir()
    same = tmp_path / "model" / "same.pt"
    same.write_bytes(b"x" * 4)
    os.utime(same, (1700000000, 1700000000))
    older = tmp_path / "model" / "older.pt"
    older.write_bytes(b"y" * 4)
    os.utime(older, (1600000000, 1600000000))
    remote = [
        Remote("model/same.pt", 4, 1700000000),
        Remote("model/older.pt", 4, 1700000000),
        Remote("model/bigger.pt", 5, 1700000000),
        Remote("logs/new.txt", 1, 1700000000),
    ]
    (tmp_path / "model" / "bigger.pt").write_bytes(b"z" * 4)
    assert [r.path for r in changed(remote, tmp_path)] == ["model/older.pt", "model/bigger.pt", "logs/new.txt"]
