"""rules/metrics.py: a trial's reports from cloudml-hypertune's file and from log lines.

Tables first (the way pyinfra tests its facts: input -> expected), then the real library:
cloudml-hypertune 0.1.0.dev6 (the `test` extra) writes the files these parsers read.
"""

from __future__ import annotations

import json
import math
import subprocess
import time

import hypertune
import pytest

from provision.core.tuning import MAX_MATCHED_LINE, Goal, Measurement, Metric, Report, measured
from provision.rules.metrics import (
    check_regex,
    metric_read_command,
    metric_read_problem,
    parse_log_lines,
    parse_metric_file,
)


def rows(reports: tuple[Report, ...]) -> list[tuple[int, str, float]]:
    """Reports as comparable rows (NaN != NaN, but its repr is 'nan')."""
    return [(r.step, repr(r.value), r.timestamp) for r in reports]


def line(tag: str, value: str, step: str = "0", ts: float = 1.5, trial: str = "0") -> bytes:
    """One line as cloudml-hypertune writes it (json.dumps, sort_keys=True)."""
    body = {"checkpoint_path": "", "global_step": step, tag: value, "timestamp": ts, "trial": trial}
    return (json.dumps(body, sort_keys=True) + "\n").encode()


L = line  # short, for the table

# (id, file bytes, tag, expected [(step, repr(value), timestamp)])
FILE_CASES = [
    ("empty", b"", "val_loss", []),
    ("one", L("val_loss", "0.987", "1000", 1525851440.12), "val_loss", [(1000, "0.987", 1525851440.12)]),
    (
        "the-spec-line",
        b'{"checkpoint_path": "", "global_step": "1000", "val_loss": "0.987", "timestamp": 1525851440.12, "trial": "0"}\n',
        "val_loss",
        [(1000, "0.987", 1525851440.12)],
    ),
    (
        "file-order-kept",
        L("m", "3.0", "30", 3.0) + L("m", "1.0", "10", 1.0) + L("m", "2.0", "20", 2.0),
        "m",
        [(30, "3.0", 3.0), (10, "1.0", 1.0), (20, "2.0", 2.0)],
    ),
    (
        "empty-tag-is-the-default",
        L("training/hptuning/metric", "0.5", "7"),
        "",
        [(7, "0.5", 1.5)],
    ),
    ("other-metric-skipped", L("accuracy", "0.9", "1") + L("val_loss", "0.4", "1"), "val_loss", [(1, "0.4", 1.5)]),
    ("default-tag-not-asked-for", L("training/hptuning/metric", "0.5"), "val_loss", []),
    ("no-step-is-0", b'{"val_loss": "0.25", "timestamp": 2.0}\n', "val_loss", [(0, "0.25", 2.0)]),
    ("step-as-float-text", L("val_loss", "0.25", "1000.0"), "val_loss", [(1000, "0.25", 1.5)]),
    ("step-as-number", b'{"global_step": 12, "val_loss": 0.5}\n', "val_loss", [(12, "0.5", 0.0)]),
    ("value-as-number", b'{"global_step": "3", "val_loss": 2}\n', "val_loss", [(3, "2.0", 0.0)]),
    ("nan-kept", L("val_loss", "nan", "5"), "val_loss", [(5, "nan", 1.5)]),
    (
        "inf-kept",
        L("val_loss", "inf", "5") + L("val_loss", "-inf", "6"),
        "val_loss",
        [(5, "inf", 1.5), (6, "-inf", 1.5)],
    ),
    ("unparsable-value-skipped", L("val_loss", "n/a", "1") + L("val_loss", "0.1", "2"), "val_loss", [(2, "0.1", 1.5)]),
    ("unparsable-step-skipped", L("val_loss", "0.3", "ten") + L("val_loss", "0.1", "nan"), "val_loss", []),
    ("bool-value-skipped", b'{"global_step": "1", "val_loss": true}\n', "val_loss", []),
    ("no-timestamp-is-0", b'{"global_step": "1", "val_loss": "0.5"}\n', "val_loss", [(1, "0.5", 0.0)]),
    (
        "partial-last-line",
        L("val_loss", "0.5", "1") + L("val_loss", "0.4", "2")[:40],
        "val_loss",
        [(1, "0.5", 1.5)],
    ),
    ("last-line-without-newline", L("val_loss", "0.5", "1").rstrip(b"\n"), "val_loss", [(1, "0.5", 1.5)]),
    (
        "garbage-bytes",
        b"\xff\xfe\x00junk\n" + L("val_loss", "0.5", "1") + b"\x80\x81\n" + L("val_loss", "0.4", "2"),
        "val_loss",
        [(1, "0.5", 1.5), (2, "0.4", 1.5)],
    ),
    ("crlf", L("val_loss", "0.5", "1").replace(b"\n", b"\r\n"), "val_loss", [(1, "0.5", 1.5)]),
    ("not-an-object", b'["val_loss", "0.5"]\n"val_loss"\nnull\n', "val_loss", []),
    ("blank-lines", b"\n\n" + L("val_loss", "0.5", "1") + b"\n\n", "val_loss", [(1, "0.5", 1.5)]),
    ("nul-bytes-of-a-truncated-rewrite", b"\x00" * 64, "val_loss", []),
]


@pytest.mark.parametrize("data,tag,expected", [pytest.param(*c[1:], id=c[0]) for c in FILE_CASES])
def test_parse_metric_file(data, tag, expected):
    assert rows(parse_metric_file(data, tag)) == expected


# (id, lines, regex, expected [(step, repr(value))])
LOG_CASES = [
    (
        "named-value-and-step",
        ["step=10 val_loss=0.5", "noise", "step=20 val_loss=0.25"],
        r"step=(?P<step>\d+) val_loss=(?P<value>\S+)",
        [(10, "0.5"), (20, "0.25")],
    ),
    ("one-group", ["loss 0.5", "loss 0.4"], r"loss (\S+)", [(1, "0.5"), (2, "0.4")]),
    (
        "named-value-no-step",
        ["a val_loss=1e-3", "val_loss=2E2"],
        r"val_loss=(?P<value>\S+)",
        [(1, "0.001"), (2, "200.0")],
    ),
    ("index-counts-reports-not-lines", ["x", "v=1", "y", "v=2"], r"v=(?P<value>\S+)", [(1, "1.0"), (2, "2.0")]),
    ("value-among-other-groups", ["epoch 3 acc 0.9"], r"(epoch) (?P<step>\d+) (acc) (?P<value>\S+)", [(3, "0.9")]),
    ("unparsable-value-skipped", ["v=abc", "v=0.5"], r"v=(?P<value>\S+)", [(1, "0.5")]),
    ("unparsable-step-skipped", ["s=x v=1", "s=2 v=3"], r"s=(?P<step>\S+) v=(?P<value>\S+)", [(2, "3.0")]),
    ("step-as-float", ["s=100.0 v=1"], r"s=(?P<step>\S+) v=(?P<value>\S+)", [(100, "1.0")]),
    (
        "optional-step-absent",
        ["v=1", "s=7 v=2", "v=3"],
        r"(?:s=(?P<step>\d+) )?v=(?P<value>\S+)",
        [(1, "1.0"), (7, "2.0"), (3, "3.0")],
    ),
    ("nan-kept", ["v=nan", "v=inf"], r"v=(?P<value>\S+)", [(1, "nan"), (2, "inf")]),
    ("first-match-in-a-line", ["v=1 v=2"], r"v=(?P<value>\S+)", [(1, "1.0")]),
    ("newlines-stripped", ["v=0.5\n", "v=0.25\r\n"], r"v=(?P<value>.+)$", [(1, "0.5"), (2, "0.25")]),
    (
        "the-example-lines",
        ["trial 3 (TF_CONFIG task.trial)", "step=20 val_loss=0.812345", "step=40 val_loss=0.1"],
        r"step=(?P<step>\d+) val_loss=(?P<value>\S+)",
        [(20, "0.812345"), (40, "0.1")],
    ),
    ("nothing-matches", ["hello"], r"v=(?P<value>\S+)", []),
]


@pytest.mark.parametrize("lines,regex,expected", [pytest.param(*c[1:], id=c[0]) for c in LOG_CASES])
def test_parse_log_lines(lines, regex, expected):
    got = parse_log_lines(iter(lines), regex)
    assert [(r.step, repr(r.value)) for r in got] == expected
    assert all(r.timestamp == 0.0 for r in got)


# (regex, None or a phrase of the reason)
REGEX_CASES = [
    (r"val_loss=(?P<value>\S+)", None),
    (r"step=(?P<step>\d+) val_loss=(?P<value>\S+)", None),
    (r"loss (\S+)", None),
    (r"(?P<value>[0-9.]+) is the loss", None),
    (r"val_loss=\S+", "no group: add (?P<value>...)"),
    (r"val_loss=(\S+", "does not compile: "),
    (r"(\d+) (\S+)", "2 groups and none named value"),
    (r"step=(?P<step>\d+)", "its only group is step"),
    (r"(?P<value>[0-9.]*)", "matches an empty line"),
    (r"(?P<v>a)\1 (?P<value>\S+)", "no backreferences or lookarounds"),
    (r"loss=(?=\d)(?P<value>\S+)", "no backreferences or lookarounds"),
]


def test_a_nested_quantifier_on_a_long_line_is_matched_in_linear_time():
    """Found by the fault round: Python's re took for ever on this, tune hung."""
    regex = r"loss=(?P<value>(\d+)+)$"
    assert check_regex(regex) is None
    start = time.monotonic()
    assert parse_log_lines(["loss=" + "1" * 40 + "x"] * 1000, regex) == ()
    parse_log_lines(["loss=" + "7" * 50_000 + "x"] * 50, regex)  # cut at MAX_MATCHED_LINE, then matched
    assert time.monotonic() - start < 1.0


def test_only_a_lines_first_characters_are_matched_and_steps_go_on_after_earlier_lines():
    regex = r"val_loss=(?P<value>\S+)"
    assert parse_log_lines(["x" * MAX_MATCHED_LINE + " val_loss=0.5"], regex) == ()
    assert parse_log_lines(["val_loss=0.5", "val_loss=0.25"], regex, before=7) == (
        Report(step=8, value=0.5),
        Report(step=9, value=0.25),
    )


def test_steps_no_storage_keeps_are_skipped():
    data = b"".join(
        json.dumps({"val_loss": "0.5", "global_step": step}).encode() + b"\n" for step in ("-3", "1e300", "4")
    )
    assert parse_metric_file(data, "val_loss") == (Report(step=4, value=0.5),)


@pytest.mark.parametrize("regex,reason", REGEX_CASES)
def test_check_regex(regex, reason):
    got = check_regex(regex)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got


def test_parse_log_lines_refuses_what_check_regex_refuses():
    with pytest.raises(ValueError, match=r"no group: add \(\?P<value>"):
        parse_log_lines(["v=1"], r"v=\S+")


# --------------------------------------------------------------------------- the real library


@pytest.fixture
def metric_file(tmp_path, monkeypatch):
    path = tmp_path / "hypertune" / "output.metrics"  # the library makes the parent
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_FILE", str(path))
    monkeypatch.setenv("CLOUD_ML_TRIAL_ID", "4")
    return path


def test_real_hypertune_reports(metric_file):
    ht = hypertune.HyperTune()
    for step, loss in [(10, 0.9), (20, 0.5), (30, float("nan")), (40, 0.25)]:
        ht.report_hyperparameter_tuning_metric(
            hyperparameter_metric_tag="val_loss", metric_value=loss, global_step=step
        )
    data = metric_file.read_bytes()
    assert json.loads(data.splitlines()[0])["trial"] == "4"
    got = parse_metric_file(data, "val_loss")
    assert [(r.step, repr(r.value)) for r in got] == [(10, "0.9"), (20, "0.5"), (30, "nan"), (40, "0.25")]
    assert all(r.timestamp > 1.6e9 for r in got)
    metric = Metric("val_loss", Goal.MINIMIZE)
    assert measured(got, metric, Measurement.LAST) == 0.25
    assert measured(got, metric, Measurement.BEST) == 0.25
    assert parse_metric_file(data, "accuracy") == ()


def test_real_hypertune_default_tag_and_no_step(metric_file):
    ht = hypertune.HyperTune()
    ht.report_hyperparameter_tuning_metric(hyperparameter_metric_tag="", metric_value=0.75)
    ht.report_hyperparameter_tuning_metric(hyperparameter_metric_tag="", metric_value="1e-3", global_step=5.0)
    assert rows(parse_metric_file(metric_file.read_bytes(), ""))[0][:2] == (0, "0.75")
    assert [(r.step, r.value) for r in parse_metric_file(metric_file.read_bytes(), "")] == [(0, 0.75), (5, 0.001)]


def test_real_hypertune_keeps_the_last_100(metric_file):
    ht = hypertune.HyperTune()
    for step in range(1, 131):
        ht.report_hyperparameter_tuning_metric(
            hyperparameter_metric_tag="val_loss", metric_value=1.0 / step, global_step=step
        )
    got = parse_metric_file(metric_file.read_bytes(), "val_loss")
    assert [r.step for r in got] == list(range(31, 131))
    assert got[-1].value == 1.0 / 130


def test_real_hypertune_two_metrics_in_one_file(metric_file):
    ht = hypertune.HyperTune()
    ht.report_hyperparameter_tuning_metric(hyperparameter_metric_tag="val_loss", metric_value=0.5, global_step=1)
    ht.report_hyperparameter_tuning_metric(hyperparameter_metric_tag="accuracy", metric_value=0.8, global_step=1)
    ht.report_hyperparameter_tuning_metric(hyperparameter_metric_tag="val_loss", metric_value=0.4, global_step=2)
    data = metric_file.read_bytes()
    assert [(r.step, r.value) for r in parse_metric_file(data, "val_loss")] == [(1, 0.5), (2, 0.4)]
    assert [(r.step, r.value) for r in parse_metric_file(data, "accuracy")] == [(1, 0.8)]


@pytest.mark.parametrize("cut", [1, 17, 60, -30, -2, -1])
def test_real_hypertune_file_cut_mid_line(metric_file, cut):
    """A reader that catches the library mid-rewrite sees a prefix: every whole line is read,
    the cut one skipped."""
    ht = hypertune.HyperTune()
    for step in (1, 2, 3):
        ht.report_hyperparameter_tuning_metric(
            hyperparameter_metric_tag="val_loss", metric_value=step / 10, global_step=step
        )
    data = metric_file.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    cut_at = last_start + cut if cut > 0 else len(data) + cut
    got = parse_metric_file(data[:cut_at], "val_loss")
    # -1 cuts only the newline: the last line is whole, and read.
    assert [r.step for r in got] == ([1, 2, 3] if cut == -1 else [1, 2])
    assert not any(math.isnan(r.value) for r in got)


def test_the_metric_file_read_refuses_what_a_host_may_plant(tmp_path):
    """The read run on the host (here: locally, by sh as there) and 38.18."""
    good = tmp_path / "good"
    good.write_text('{"loss": "0.5", "global_step": "3"}\n')
    (tmp_path / "zero").symlink_to("/dev/zero")
    other = tmp_path / "other"
    other.write_text("x\n")
    (tmp_path / "hard").hardlink_to(other)
    (tmp_path / "big").write_bytes(b"\n" * 2_000_000)
    (tmp_path / "dir").mkdir()
    expected = {
        "good": None,
        "missing": None,
        "zero": "a symbolic link",
        "hard": "a hard link (2 names)",
        "big": "2000000 bytes, over the cap of 1048576",
        "dir": "not a regular file",
    }
    for name, why in expected.items():
        r = subprocess.run(metric_read_command(str(tmp_path / name)), shell=True, capture_output=True, timeout=10)
        assert metric_read_problem(r.returncode, r.stderr, len(r.stdout)) == why, name
    r = subprocess.run(metric_read_command(str(good)), shell=True, capture_output=True, timeout=10)
    assert parse_metric_file(r.stdout, "loss") == (Report(step=3, value=0.5),)
    assert metric_read_problem(0, b"", 1_048_577) == "the host sent more than 1048576 bytes"
