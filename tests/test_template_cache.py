"""The compiled templates kept between runs (render._template_cache): made private to the
user, used on the next run, and never a reason to fail (unreadable, corrupt, foreign)."""

from __future__ import annotations

import os

import pytest

from provision.render import files as render


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    render._jinja.cache_clear()
    yield tmp_path / "provision" / "templates"
    render._jinja.cache_clear()


def text(name: str = "job.target.j2") -> str:
    return (
        render._jinja()
        .get_template(name)
        .render(job="j", host="h", boot_target="multi-user.target", tasks=["chief-0"], units=["a.service"])
    )


def test_compiled_once_then_loaded(fresh):
    first = text()
    entries = sorted(fresh.iterdir())
    assert entries and oct(fresh.stat().st_mode & 0o777) == "0o700"
    render._jinja.cache_clear()
    assert text() == first
    assert sorted(fresh.iterdir()) == entries


def test_a_corrupt_entry_is_compiled_again(fresh):
    first = text()
    for f in fresh.iterdir():
        f.write_bytes(b"not a jinja cache")
    render._jinja.cache_clear()
    assert text() == first


def test_a_directory_others_can_write_is_not_used(fresh):
    fresh.mkdir(parents=True)
    os.chmod(fresh, 0o777)
    assert render._template_cache() is None
    text()
    assert list(fresh.iterdir()) == []
