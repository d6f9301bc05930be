"""The job page's timeline (web/timecharts.py): its time axis says each time once."""

from __future__ import annotations

import re

from provision.web.timecharts import timeline_svg


def _row(started: str, ended: str) -> dict[str, object]:
    return {
        "kind": "run", "job": "j", "owner": "ana", "started": started, "ended": ended, "seconds": 1.0,
        "state": "succeeded", "how": "", "hosts": ["h"], "gpus": 1, "gpu_hours": 0.0, "submission": "",
    }  # fmt: skip


def _labels(svg: str) -> list[str]:
    return re.findall(r'text-anchor="middle">([0-9:TZ -]+)</text>', svg)


def test_a_run_of_one_second_says_each_tick_once():
    svg = str(timeline_svg([_row("2026-12-02T02:30:01Z", "2026-12-02T02:30:02Z")], [], 0.0))  # type: ignore[list-item]
    labels = _labels(svg)
    assert labels and len(labels) == len(set(labels)), labels


def test_an_hour_long_run_has_its_ticks():
    svg = str(timeline_svg([_row("2026-12-02T01:00:00Z", "2026-12-02T01:50:00Z")], [], 0.0))  # type: ignore[list-item]
    assert len(_labels(svg)) >= 3
