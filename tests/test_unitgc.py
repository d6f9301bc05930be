"""host/unitgc.py: which units destroy asks systemd about before it skips the daemon-reload,
as a table: the manifest's files, the paths still on the host afterwards, the units stopped."""

from __future__ import annotations

import os
from typing import Any

import pytest

from provision.host import layout, unitgc

U = layout.SYSTEMD_DIR + "/provision-j-chief-0.service"
T = layout.SYSTEMD_DIR + "/provision-j.target"
SETUP = layout.SYSTEMD_DIR + "/provision-setup-abc.service"
CASES: list[tuple[str, list[str], list[str], list[str], list[str] | None]] = [
    # (what, manifest files, paths left afterwards, units stopped, units asked or None: reload)
    (
        "the job's unit and target gone",
        [U, T, "/opt/a.py"],
        [],
        ["provision-j-chief-0.service"],
        ["provision-j-chief-0.service", "provision-j.target"],
    ),
    ("a file kept for another job asks nothing", ["/opt/a.py"], ["/opt/a.py"], [], []),
    (
        "a setup unit the study holds: its file stays, not asked",
        [U, SETUP],
        [SETUP],
        ["provision-j-chief-0.service", "provision-setup-abc.service"],
        ["provision-j-chief-0.service"],
    ),
    (
        "a stopped unit whose file is gone is asked",
        ["/opt/a.py"],
        [],
        ["provision-j-chief-0.service"],
        ["provision-j-chief-0.service"],
    ),
    (
        "the boot link is read at boot only",
        [U, layout.SYSTEMD_DIR + "/multi-user.target.wants/provision-j.target"],
        [],
        [],
        ["provision-j-chief-0.service"],
    ),
    (
        "a drop-in gone: its unit asked",
        ["/run/systemd/system/provision-x.service.d/a.conf"],
        [],
        [],
        ["provision-x.service"],
    ),
    (
        "a drop-in put back (its original): reload",
        ["/usr/lib/systemd/system/provision-x.service.d/a.conf"],
        ["/usr/lib/systemd/system/provision-x.service.d/a.conf"],
        [],
        None,
    ),
    (
        "a drop-in for every unit of a prefix: reload",
        ["/etc/systemd/system/provision-x-.service.d/a.conf"],
        [],
        [],
        None,
    ),
    (
        "another unit's file (a replace: true push): reload",
        ["/usr/lib/systemd/system/other.service"],
        ["/usr/lib/systemd/system/other.service"],
        [],
        None,
    ),
    ("systemd's own configuration: reload", ["/etc/systemd/system.conf.d/x.conf"], [], [], None),
    ("no manifest: reload", [], [], ["provision-j-chief-0.service"], None),
]


@pytest.mark.parametrize(("files", "left", "units", "asked"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_units_destroy_asks_about(
    monkeypatch: pytest.MonkeyPatch, files: list[str], left: list[str], units: list[str], asked: list[str] | None
) -> None:
    monkeypatch.setattr(os.path, "lexists", lambda p: p in left)
    manifest: dict[str, Any] = {"files": {f: {"sha256": "0" * 64} for f in files}}
    got = unitgc._units_changed(manifest, units)
    assert got == (sorted(asked) if asked is not None else None)


@pytest.mark.parametrize(
    ("out", "code", "forgotten"),
    [
        ("not-found\n\nnot-found\n", 0, True),
        ("not-found\n\nloaded\n", 0, False),
        ("not-found\n", 0, False),
        ("", 1, False),
    ],
)
def test_forgotten_only_when_systemd_holds_none(
    monkeypatch: pytest.MonkeyPatch, out: str, code: int, forgotten: bool
) -> None:
    monkeypatch.setattr(unitgc, "run", lambda argv, timeout=60: (code, out, ""))
    assert unitgc._forgotten(["a.service", "b.service"]) is forgotten
    assert unitgc.needs_reload({"files": {}}, []) is True  # nothing known: reload
