"""bench/compare.py's `timed`: a tool's peak RSS is its own, not the bench's.

Linux folds the forked copy's high-water mark into a child's ru_maxrss at exec, so a tool
forked straight from the bench (paramiko, docker, 128 connections) reported the bench's
size; compare.py starts tools from a small spawner instead."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "compare.py"


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("bench_compare", BENCH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_a_small_tool_is_not_charged_with_the_bench_memory(compare, tmp_path):
    ballast = bytearray(300 * 1024 * 1024)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # touch every page: 300 MiB resident
    small = compare.timed([sys.executable, "-S", "-c", "pass"], cwd=tmp_path, log_path=tmp_path / "log")
    big = compare.timed(
        [sys.executable, "-S", "-c", "b = bytearray(80 << 20); b[::4096] = bytes(len(b[::4096]))"],
        cwd=tmp_path,
        log_path=tmp_path / "log",
    )
    del ballast
    assert small.maxrss_kib < 50 * 1024, small
    assert 80 * 1024 < big.maxrss_kib < 150 * 1024, big
    assert small.exit_code == 0 and small.seconds > 0 and small.cpu_seconds >= 0


def test_exit_codes_output_and_missing_programs(compare, tmp_path):
    log = tmp_path / "log"
    run = compare.timed(["sh", "-c", "echo out; echo err >&2; exit 3"], cwd=tmp_path, log_path=log, ok_codes=(3,))
    assert run.exit_code == 3
    assert "out\nerr\n" in log.read_text()
    with pytest.raises(RuntimeError, match="exit 3"):
        compare.timed(["sh", "-c", "exit 3"], cwd=tmp_path, log_path=log)
    with pytest.raises(RuntimeError, match="exit 127"):
        compare.timed(["no-such-program-here"], cwd=tmp_path, log_path=log)
    assert "no-such-program-here" in log.read_text()
