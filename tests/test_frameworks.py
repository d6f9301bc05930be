"""sandbox/frameworks.py: the pip calls that build a framework layer (no pip is run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from provision.sandbox import frameworks as F


def test_every_sdist_only_requirement_is_in_a_layer():
    assert F.SDIST_ONLY <= {r for reqs in F.FRAMEWORKS.values() for r in reqs}


def test_the_torch_layer_has_what_tuning_trials_report_with():
    assert "cloudml-hypertune==0.1.0.dev6" in F.FRAMEWORKS["torch"]


def test_same_python_one_call(monkeypatch):
    monkeypatch.setattr(F, "_cross", lambda: False)
    (cmd,) = F._pip_commands(Path("/t"), F.FRAMEWORKS["torch"])
    assert cmd[-3:] == list(F.FRAMEWORKS["torch"])
    assert "--only-binary=:all:" not in cmd and "--no-deps" not in cmd


@pytest.mark.parametrize("name", sorted(F.FRAMEWORKS))
def test_another_python_wheels_then_sdists_without_deps(monkeypatch, name):
    """--only-binary=:all: (which --python-version needs) refuses an sdist; pip allows one with
    --no-deps, so the pure-Python sdists get a call of their own."""
    monkeypatch.setattr(F, "_cross", lambda: True)
    reqs = F.FRAMEWORKS[name]
    cmds = F._pip_commands(Path("/t"), reqs)
    wheels = [r for r in reqs if r not in F.SDIST_ONLY]
    pure = [r for r in reqs if r in F.SDIST_ONLY]
    assert len(cmds) == 1 + bool(pure)
    assert cmds[0][-len(wheels) :] == wheels and "--only-binary=:all:" in cmds[0] and "--no-deps" not in cmds[0]
    if pure:
        assert cmds[1][-len(pure) :] == pure and "--no-deps" in cmds[1] and "--only-binary=:all:" not in cmds[1]
    for cmd in cmds:
        assert cmd[cmd.index("--python-version") + 1] == "3.11" and cmd[cmd.index("--target") + 1] == "/t"
