"""How a study is shown (cli/tuneview.py): the trials table, the --json document (against
docs/tuning.md's example, as tests/test_json_shapes.py checks the others), the PNG and the
progress lines. No hosts, no Optuna: rows as the engine would read them back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest

from provision.cli import tunecmd
from provision.cli.tuneview import (
    _off_the_chart,
    best_so_far,
    compact,
    digits,
    draw_png,
    event_line,
    figure,
    log_scale,
    study_json,
    table_lines,
)
from provision.core.tuning import EarlyStopping, Goal, Metric, Param, ParamType, Scale, TrialRow, TrialState, Tune
from test_json_shapes import TUNING, check, documented

S = TrialState
TUNE = Tune(
    Metric("val_loss", Goal.MINIMIZE),
    (
        Param("learning_rate", ParamType.DOUBLE, 1e-5, 1e-1, Scale.LOG),
        Param("batch_size", ParamType.DISCRETE, values=(32, 64, 128)),
        Param("optimizer", ParamType.CATEGORICAL, values=("adam", "sgd")),
        # Conditional: only the sgd trials have it.
        Param("momentum", ParamType.DOUBLE, 0.0, 0.99, parent="optimizer", parent_values=("sgd",)),
    ),
    max_trials=12,
    parallel_trials=4,
)


def _p(lr: float, bs: int, opt: str, momentum: float | None = None) -> tuple[tuple[str, float | int | str], ...]:
    out: tuple[tuple[str, float | int | str], ...] = (("learning_rate", lr), ("batch_size", bs), ("optimizer", opt))
    return out + ((("momentum", momentum),) if momentum is not None else ())


ROWS = (
    TrialRow(
        1, _p(0.00031622776601683794, 64, "adam"), S.SUCCEEDED, 0.41234567, 1000, 754.2, "chief-0 exited 0", "mnist-t1"
    ),
    TrialRow(2, _p(0.01, 32, "sgd", 0.9), S.SUCCEEDED, 0.3312, 1000, 65.0, "chief-0 exited 0", "mnist-t2"),
    TrialRow(
        3, _p(0.05, 128, "sgd", 0.5), S.STOPPED_EARLY, 0.9, 30, 20.0, "worse than the median at step 30", "mnist-t3"
    ),
    TrialRow(4, _p(1e-5, 32, "adam"), S.FAILED, None, None, 3.0, "chief-0 exited 1", "mnist-t4"),
    TrialRow(5, _p(0.002, 64, "adam"), S.SUCCEEDED, 0.2501, 1000, 60.0, "chief-0 exited 0", "mnist-t5"),
    TrialRow(6, _p(1e-5, 32, "adam"), S.RUNNING, 0.5, 40, 12.0, "", "mnist-t6", retry_of=4),
    TrialRow(7, _p(0.003, 64, "adam"), S.RUNNING, job="mnist-t7"),
)


@pytest.fixture(autouse=True)
def _plain(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")


# --------------------------------------------------------------------------- numbers


def test_compact_values_and_digits():
    assert [compact(v) for v in (0.00031622776601683794, 12.5, 1e-5, 64, "adam", True)] == [
        "0.0003162",
        "12.5",
        "1e-05",
        "64",
        "adam",
        "true",
    ]
    assert digits([0.1234, 0.5]) == 4
    assert digits([0.12341, 0.12342]) == 5  # 4 digits would show them alike
    assert digits([0.123401, 0.123402]) == 6  # and never more than 6
    assert digits([]) == 4


# --------------------------------------------------------------------------- the table


def test_table_lines():
    lines = table_lines(ROWS, TUNE)
    assert lines == [
        "TRIAL           learning_rate  batch_size  optimizer  momentum  STATE          val_loss  STEP  TIME  WHY",
        "1               0.0003162      64          adam                 succeeded      0.4123    1000  12m   chief-0 exited 0",
        "2               0.01           32          sgd        0.9       succeeded      0.3312    1000  65s   chief-0 exited 0",
        "3               0.05           128         sgd        0.5       stopped early  0.9       30    20s   worse than the median at step 30",
        "4               1e-05          32          adam                 failed                         3s    chief-0 exited 1",
        "5               0.002          64          adam                 succeeded      0.2501    1000  60s   chief-0 exited 0",
        "6 (retry of 4)  1e-05          32          adam                 running        0.5       40    12s",
        "7               0.003          64          adam                 running",
        "",
        "Best: trial 5, val_loss=0.2501 (--learning_rate=0.002 --batch_size=64 --optimizer=adam)",
        "7 trials: 3 succeeded, 1 stopped early, 1 failed, 2 running (max_trials 12, parallel 4)",
    ]


def test_the_table_has_a_rung_column_with_hyperband_and_asha():
    rows = (TrialRow(1, (), S.SUCCEEDED, 0.2, 9, 5.0, rung=2), TrialRow(2, (), S.RUNNING, 0.5, 2, 1.0))
    for rule in (EarlyStopping.HYPERBAND, EarlyStopping.ASHA):
        lines = table_lines(rows, Tune(Metric("loss", Goal.MINIMIZE), (), max_trials=2, early_stopping=rule))
        assert lines[:3] == [
            "TRIAL  STATE      loss  STEP  RUNG  TIME  WHY",
            "1      succeeded  0.2   9     2     5s",
            "2      running    0.5   2           1s",
        ], lines
    assert "RUNG" not in table_lines(rows, Tune(Metric("loss", Goal.MINIMIZE), (), max_trials=2))[0]


def test_table_of_no_trials_and_of_a_maximized_metric():
    assert table_lines((), TUNE)[-2:] == [
        "Best: none yet",
        "0 trials: 0 succeeded, 0 stopped early, 0 failed, 0 running (max_trials 12, parallel 4)",
    ]
    up = Tune(Metric("accuracy", Goal.MAXIMIZE), (), max_trials=1)
    one = (TrialRow(1, (), S.SUCCEEDED, 0.91, 5, 1.0), TrialRow(2, (), S.SUCCEEDED, 0.9, 5, 1.0))
    assert table_lines(one, up)[-2:] == [
        "Best: trial 1, accuracy=0.91",
        "2 trials: 2 succeeded, 0 stopped early, 0 failed, 0 running (max_trials 1, parallel 1)",
    ]
    # Values 4 digits would show alike get more.
    close = (TrialRow(1, (), S.SUCCEEDED, 0.123451), TrialRow(2, (), S.SUCCEEDED, 0.123459))
    assert "0.12345" in table_lines(close, up)[1] and "0.12346" in table_lines(close, up)[2]


def test_table_colours_only_without_no_color(monkeypatch):
    assert not any("\x1b[" in line for line in table_lines(ROWS, TUNE))
    monkeypatch.delenv("NO_COLOR")
    coloured = table_lines(ROWS, TUNE)
    assert "\x1b[31m" in coloured[4]  # the failed trial in red
    monkeypatch.setenv("NO_COLOR", "1")
    assert [click.unstyle(line) for line in coloured] == table_lines(ROWS, TUNE)


# --------------------------------------------------------------------------- --json


def test_study_json_has_the_documented_shape():
    real = json.loads(json.dumps(study_json("mnist", TUNE, ROWS, ended=None, picture=".provision/mnist.tune.png")))
    check("tune --status --json", real, TUNING)
    assert real["best"]["number"] == 5 and real["trials"][3]["value"] is None
    assert "momentum" not in real["trials"][0]["params"] and real["trials"][1]["params"]["momentum"] == 0.9
    assert real["counts"] == {"succeeded": 3, "stopped early": 1, "failed": 1, "running": 2}
    assert (real["ended"], real["picture"]) == (None, ".provision/mnist.tune.png")
    ended = study_json("mnist", TUNE, (), ended="max_trials reached", picture=None)
    check("tune --status --json", json.loads(json.dumps(ended)), TUNING)
    assert ended["best"] is None and ended["trials"] == [] and ended["ended"] == "max_trials reached"


def test_documented_study_keys_are_exactly_study_json_keys():
    """Nothing elided at the top: every key of the document is documented, and only those."""
    doc = documented("tune --status --json", TUNING)
    assert set(doc) == set(study_json("j", TUNE, ROWS, ended=None, picture=None))
    assert set(doc["trials"][0]) == set(ROWS[0].to_json())


# --------------------------------------------------------------------------- progress lines


def test_event_lines():
    assert [event_line(r, TUNE) for r in ROWS] == [
        "trial 1 succeeded: val_loss=0.412346 at step 1000 after 12m",
        "trial 2 succeeded: val_loss=0.3312 at step 1000 after 65s",
        "trial 3 stopped early at step 30: worse than the median at step 30",
        "trial 4 failed: chief-0 exited 1",
        "trial 5 succeeded: val_loss=0.2501 at step 1000 after 60s",
        "trial 6 started (retry of trial 4): --learning_rate=1e-05 --batch_size=32 --optimizer=adam",
        "trial 7 started: --learning_rate=0.003 --batch_size=64 --optimizer=adam",
    ]
    assert event_line(TrialRow(8, (), S.FAILED), TUNE) == "trial 8 failed"
    assert event_line(TrialRow(9, (), S.STOPPED_EARLY, why="worse"), TUNE) == "trial 9 stopped early: worse"
    assert event_line(TrialRow(10, (("optimizer", "sgd"),), S.RUNNING), TUNE) == "trial 10 started: --optimizer=sgd"


# --------------------------------------------------------------------------- the picture


def test_best_so_far_respects_the_goal():
    assert best_so_far(ROWS, TUNE) == ([1, 2, 5], [0.41234567, 0.3312, 0.2501])
    up = Tune(Metric("val_loss", Goal.MAXIMIZE), (), max_trials=9)
    assert best_so_far(list(reversed(ROWS)), up) == ([1], [0.41234567])  # trial-number order, not the rows'


def _read_png(path):
    import matplotlib.image  # only to read the picture back

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(path))
    assert img.shape[0] > 0 and img.shape[1] > 0
    return img


@pytest.mark.parametrize(
    "rows",
    [ROWS, (), ROWS[3:4], tuple(reversed(ROWS))],
    ids=["all-states", "no-trials", "only-failed", "out-of-order"],
)
def test_png_is_written(tmp_path, rows):
    path = tmp_path / "state" / "mnist.tune.png"
    draw_png(path, rows, TUNE)
    _read_png(path)
    assert [p.name for p in path.parent.iterdir()] == ["mnist.tune.png"]  # no temp file left


def test_png_of_one_log_and_one_categorical_parameter(tmp_path):
    for params in (TUNE.params[:1], TUNE.params[2:3]):
        tune = Tune(Metric("accuracy", Goal.MAXIMIZE), params, max_trials=3)
        path = tmp_path / f"{params[0].name}.png"
        draw_png(path, ROWS, tune, job="mnist")
        small = _read_png(path)
    big = tmp_path / "big.png"
    draw_png(big, ROWS, TUNE)
    assert _read_png(big).shape[0] > small.shape[0]  # a row of panels per 3 parameters


def test_png_replaces_the_old_one_whole(tmp_path, monkeypatch):
    path = tmp_path / "mnist.tune.png"
    path.write_bytes(b"old")
    draw_png(path, ROWS, TUNE)
    _read_png(path)

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    from matplotlib.figure import Figure  # only to break it

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(RuntimeError):
        draw_png(path, (), TUNE)
    _read_png(path)  # the previous picture, untouched
    assert [p.name for p in tmp_path.iterdir()] == ["mnist.tune.png"]


def test_importing_tuneview_does_not_import_matplotlib_or_optuna():
    code = "import sys, provision.cli.tuneview; print(sorted(m for m in ('matplotlib', 'optuna') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_png_of_extreme_values_is_drawn_and_says_so(tmp_path):
    """trials reporting 1.7e308 and 0 made every later `provision tune` end in a
    drawing traceback."""
    tune = Tune(Metric("loss", Goal.MINIMIZE), (Param("lr", ParamType.DOUBLE, 0.0, 1.0),), 4)
    rows = [
        TrialRow(1, (("learning_rate", 0.1),), TrialState.SUCCEEDED, 1.7e308, job="j-t1"),
        TrialRow(2, (("lr", 0.2),), TrialState.SUCCEEDED, 0.0, job="j-t2"),
        TrialRow(3, (("lr", 0.3),), TrialState.STOPPED_EARLY, -1e200, job="j-t3"),
    ]
    out = tmp_path / "study.png"
    draw_png(out, rows, tune)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _off_the_chart(rows) == 2


def test_the_metric_axis_is_log_when_positive_values_span_decades():
    assert log_scale([3.1, 0.0093, 0.0099])
    assert not log_scale([0.25, 0.41, 0.9])  # within a decade: linear reads better
    assert not log_scale([-1.0, 3.0, 300.0]) and not log_scale([0.0, 3.0])  # not all positive
    assert not log_scale([])


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_png_marks_the_best_trial_and_where_stopped_trials_stopped():
    """item 5: 0.0093 and 0.0099 both sat on 0 on a linear axis up to 3.1; the best
    trial is marked and named; a stopped trial says its step; the best-so-far line moves."""
    tune = Tune(Metric("val_loss", Goal.MINIMIZE), (Param("lr", ParamType.DOUBLE, 1e-4, 1.0, Scale.LOG),), 6)
    rows = [
        TrialRow(1, (("lr", 0.5),), S.SUCCEEDED, 3.1, 20, 5.0, "chief-0 exited 0", "j-t1"),
        TrialRow(2, (("lr", 0.01),), S.SUCCEEDED, 0.0099, 20, 5.0, "chief-0 exited 0", "j-t2"),
        TrialRow(3, (("lr", 0.3),), S.STOPPED_EARLY, 2.0, 8, 2.0, "best val_loss 2 ...", "j-t3"),
        TrialRow(4, (("lr", 0.02),), S.SUCCEEDED, 0.0093, 20, 5.0, "chief-0 exited 0", "j-t4"),
        TrialRow(5, (("lr", 0.1),), S.FAILED, None, None, 1.0, "chief-0 exited 1", "j-t5"),
    ]
    fig = figure(rows, tune, job="j")
    top, panel = fig.axes[0], fig.axes[1]
    assert top.get_yscale() == "log" and panel.get_yscale() == "log"
    assert "best: trial 4, val_loss 0.0093" in _texts(top)
    assert "step 8" in _texts(top)
    line = next(ln for ln in top.get_lines() if ln.get_label() == "best so far")
    assert len(set(line.get_ydata())) == 3  # 3.1, then 0.0099, then 0.0093
    linear = figure([TrialRow(1, (("lr", 0.5),), S.SUCCEEDED, 0.4, job="j-t1")], tune, job="j")
    assert linear.axes[0].get_yscale() == "linear"


def test_no_matplotlib_warning_reaches_the_terminal(tmp_path):
    """A second runner joining drew a study with no labelled artist: "No artists with labels
    found" on stderr among the trials' lines. Drawn in a fresh interpreter (matplotlib warns
    once per place), with every warning shown: stderr stays empty, and a warning matplotlib
    raises from inside draw_png is not shown either."""
    code = (
        "import sys, warnings; from pathlib import Path; sys.path[:0] = [sys.argv[1], sys.argv[2]];"
        "warnings.simplefilter('always');"
        "import test_tuneview as t; import provision.cli.tuneview as v;"
        "[v.draw_png(Path(sys.argv[3]) / f'{i}.png', rows, t.TUNE) for i, rows in "
        "enumerate([t.ROWS, (), t.ROWS[3:4], t.ROWS[5:], t.ROWS[6:]])];"
        # A legend of nothing drawn by tuneview's own code: what matplotlib warned about.
        "exec('def _metric_panel(ax, rows, tune): ax.legend()', v.__dict__);"
        "v.draw_png(Path(sys.argv[3]) / 'x.png', t.ROWS, t.TUNE)"
    )
    src = Path(__file__).resolve().parents[1] / "src"
    out = subprocess.run(
        [sys.executable, "-c", code, str(src), str(Path(__file__).parent), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""


def test_the_last_picture_is_drawn_once_every_trial_is_told_and_not_again_at_the_end(tmp_path, monkeypatch):
    """The study's last picture starts as soon as no trial runs (beside the last trials'
    removal), and the end draws it again only if the rows changed since."""
    drawn: list[int] = []
    monkeypatch.setattr(tunecmd, "_draw", lambda path, rows, tune: drawn.append(len(rows)))
    pic = tunecmd._Picture(tmp_path / "study.png", TUNE)
    told = [r for r in ROWS if r.state is not S.RUNNING]
    pic.maybe(list(ROWS))
    assert drawn == []  # within EVERY seconds of the start: not yet
    pic.maybe(told, final=True)
    pic.wait()
    assert drawn == [len(told)]
    pic.last(list(told))
    assert drawn == [len(told)]  # nothing changed: not drawn again
    pic.last(told[:-1])
    assert drawn == [len(told), len(told) - 1]


def test_a_followed_study_says_its_trials_pauses_and_resumes_as_a_terminal_that_runs_it(monkeypatch, capsys):
    """`provision tune` of a handed-over study (servecmd.follow_study) prints the lines the
    terminal that runs a study prints when a trial is preempted and when it resumes
    (run/tune.py), read from the rows' why as `tune --status` shows them."""
    import dataclasses

    from provision.cli import servecmd
    from provision.io.servicestore import Kind, Status, Submission

    tune = TUNE
    why = "preempted by hi (ana@lab, priority high); resumes when 2 GPUs are free"
    looks = [
        [TrialRow(1, (("learning_rate", 0.1),), TrialState.RUNNING, why="running on host-1")],
        [TrialRow(1, (("learning_rate", 0.1),), TrialState.RUNNING, why=f"paused: {why}")],
        [TrialRow(1, (("learning_rate", 0.1),), TrialState.RUNNING, why=f"paused: {why}")],
        [TrialRow(1, (("learning_rate", 0.1),), TrialState.RUNNING, why="resuming (room returned)")],
        [TrialRow(1, (("learning_rate", 0.1),), TrialState.RUNNING, why="running on host-1, host-2")],
        [TrialRow(1, (("learning_rate", 0.1),), TrialState.SUCCEEDED, value=0.5, steps=3)],
    ]
    sub = Submission("s1", Kind.TUNE, "j", "bob@lab", "local", "", "inv.yaml", {}, status=Status.RUNNING)

    class Store:
        def get(self, sid: str) -> Submission:
            return dataclasses.replace(sub, status=Status.DONE if not looks else Status.RUNNING)

        def close(self) -> None:
            pass

    monkeypatch.setattr(servecmd.time, "sleep", lambda s: None)
    code = servecmd.follow_study(Store(), sub, lambda: looks.pop(0), lambda r: event_line(r, tune))  # type: ignore[arg-type]
    assert code == 0
    out = capsys.readouterr().out.splitlines()
    assert [x.split(":")[0] if x.startswith("trial 1 succeeded") else x for x in out[1:]] == [
        "trial 1 started: --learning_rate=0.1",
        f"trial 1 paused: {why}",
        "trial 1 resumed on host-1, host-2 (from its checkpoint)",
        "trial 1 succeeded",
        "Submission s1 done.",
    ], out
