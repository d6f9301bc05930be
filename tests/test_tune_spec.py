"""`tune:` as the inventory parser reads it, a trial's inventory as a study derives it, and a
promoted trial's inventory: pure, no hosts (the study on hosts: integration/test_tune.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from provision.core.errors import ValidationError
from provision.core.tuning import (
    Algorithm,
    EarlyStopping,
    Goal,
    Measurement,
    ParamType,
    Report,
    Scale,
    TrialRow,
    TrialState,
    best,
    measured,
)
from provision.inventory.inventory import parse
from provision.inventory.promote import promoted
from provision.inventory.trial import trial_inventory, with_flags
from provision.render.files import render

_spec = importlib.util.spec_from_file_location("_provision_test_encode", Path(__file__).with_name("test_encode.py"))
_ports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ports)  # type: ignore[union-attr]
parse_env_file, parse_exec = _ports.parse_env_file, _ports.parse_exec

BASE = """\
job: sweep
hosts:
  - {name: a, address: 192.0.2.1, accelerators: {type: nvidia-tesla-t4, count: 2}}
pools:
  chief: {replicas: 1, accelerators: 1, command: [python3, /opt/t.py]}
"""

TUNE = """\
tune:
  metric: {name: val_loss, goal: minimize}
  parameters:
    learning_rate: {type: double, min: 1.0e-4, max: 1.0, scale: log}
    batch_size: {type: discrete, values: [32, 64, 128]}
    optimizer: {type: categorical, values: [adam, sgd]}
    momentum: {type: double, min: 0, max: 0.99, when: {optimizer: [sgd]}}
  max_trials: 12
  parallel_trials: 4
  early_stopping: median
"""


def _inv(tune: str = TUNE, base: str = BASE):
    return parse(base + tune, Path("/x/study.yaml"), "study.yaml")


def _problems(tune: str, base: str = BASE) -> list[str]:
    with pytest.raises(ValidationError) as e:
        _inv(tune, base)
    return e.value.problems


def test_a_tune_section_becomes_a_study():
    t = _inv().tune
    assert t is not None
    assert (t.metric.name, t.metric.goal) == ("val_loss", Goal.MINIMIZE)
    assert [p.name for p in t.params] == ["learning_rate", "batch_size", "optimizer", "momentum"]
    lr, bs, opt, mom = t.params
    assert (lr.type, lr.min, lr.max, lr.scale) == (ParamType.DOUBLE, 1e-4, 1.0, Scale.LOG)
    assert bs.values == (32, 64, 128) and opt.values == ("adam", "sgd")
    assert (mom.parent, mom.parent_values) == ("optimizer", ("sgd",))
    assert (t.max_trials, t.parallel_trials, t.max_failed_trials) == (12, 4, 3)
    assert (t.algorithm, t.early_stopping) == (Algorithm.BAYESIAN, EarlyStopping.MEDIAN)


@pytest.mark.parametrize(
    "tune, expected",
    [
        (
            "tune: {metric: {name: l, goal: minimise}, parameters: {a: {type: double, min: 0, max: 1}}, max_trials: 2}",
            "tune.metric.goal: expected one of maximize, minimize, got 'minimise' (did you mean 'minimize'?)",
        ),
        (
            "tune: {metric: {name: l, goal: minimize}, parameters: {a: {type: double, min: 0, max: 1, scale: log}}, max_trials: 2}",
            "tune.parameters.a.min: a log scale needs a positive range, got min 0",
        ),
        (
            "tune: {metric: {name: l, goal: minimize}, parameters: {a: {type: double, min: 2, max: 1}}, max_trials: 2}",
            "tune.parameters.a: min 2 is above max 1",
        ),
        (
            "tune: {metric: {name: l, goal: minimize}, parameters: {a: {type: discrete, values: [2, 1]}}, max_trials: 2}",
            "tune.parameters.a.values: discrete values go in increasing order",
        ),
        (
            "tune: {metric: {name: l, goal: minimize}, parameters: {'a b': {type: double, min: 0, max: 1}}, max_trials: 2}",
            "a parameter name becomes --NAME=VALUE",
        ),
        (
            "tune: {metric: {name: l, goal: minimize}, parameters: {a: {type: double, min: 0, max: 1}}, max_trials: 2, algorithm: grid}",
            "tune.parameters.a: a grid search takes integer, discrete and categorical parameters, not double",
        ),
        (
            "tune: {metric: {name: l, goal: minimize}, parameters: {m: {type: double, min: 0, max: 1, when: {opt: [sgd]}}}, max_trials: 2}",
            "tune.parameters.m.when: no parameter named 'opt'",
        ),
        (
            "tune: {metric: {name: l, goal: minimize, regex: 'l=\\d+'}, parameters: {a: {type: double, min: 0, max: 1}}, max_trials: 2}",
            "tune.metric.regex: no group: add (?P<value>...)",
        ),
        (
            "tune: {metric: {name: l, goal: minimize}, parameters: {a: {type: double, min: 0, max: 1}}, max_trials: 2, storage: 'postgresql://u:secret@db/x'}",
            "tune.storage: a password in the URL is not accepted",
        ),
        (
            "tune: {metric: {name: l, goal: minimize}, parameters: {a: {type: categorical, values: [[1, 2]]}}, max_trials: 2}",
            "tune.parameters.a.values[0]: expected a string, got a list",
        ),
        (
            "tune: {metric: {name: l, goal: minimize}, parameters: {a: {type: categorical, values: ['a\\0b']}}, max_trials: 2}".replace(
                "'a\\0b'", '"a\\0b"'
            ),
            "tune.parameters.a.values[0]: NUL bytes are not allowed",
        ),
        (
            "tune: {metric: {name: l, goal: minimize}, parameters: {}, max_trials: 2}",
            "tune.parameters: expected at least one parameter",
        ),
        (
            "tune: {metric: {name: l, goal: minimize}, parameters: {a: {type: double, min: 0, max: 1}}, max_trials: 2, early_stopping: hyperbnd}",
            "tune.early_stopping: expected one of none, median, hyperband, asha, got 'hyperbnd'",
        ),
    ],
)
def test_bad_tune_sections_are_named_by_their_key_path(tune, expected):
    problems = _problems(tune + "\n")
    assert any(expected in p for p in problems), problems
    assert all(p.startswith("study.yaml:") for p in problems), problems


@pytest.mark.parametrize("rule", ["none", "median", "hyperband", "asha"])
def test_each_early_stopping_rule_is_parsed(rule):
    t = _inv(TUNE.replace("early_stopping: median", f"early_stopping: {rule}")).tune
    assert t is not None and t.early_stopping is EarlyStopping(rule)


def test_a_trials_name_must_stay_a_dns_label():
    base = BASE.replace("job: sweep", "job: " + "a" * 38)
    problems = _problems(TUNE, base)
    assert any("keep the job's name to at most 36 characters" in p for p in problems), problems


def test_a_trial_is_the_study_with_its_arguments_and_number():
    inv = _inv()
    t = trial_inventory(inv, 3, {"learning_rate": 0.01, "batch_size": 64, "optimizer": "adam"})
    assert t.job == "sweep-t3" and t.tf_config.trial == "3"
    assert t.pools[0].command == ("python3", "/opt/t.py", "--learning_rate=0.01", "--batch_size=64", "--optimizer=adam")
    env = next(f for f in render(t).hosts["a"].files if f.path.endswith("chief-0.env")).data().decode()
    assert 'CLOUD_ML_TRIAL_ID="3"' in env and 'CLOUD_ML_HP_METRIC_TAG="val_loss"' in env
    assert 'CLOUD_ML_HP_METRIC_FILE="/var/lib/provision/sweep-t3/hypertune/chief-0.metrics"' in env
    assert '\\"trial\\":\\"3\\"' in env  # CLUSTER_SPEC's task.trial
    # The study itself, applied as a plain job, has no trial and no metric file.
    plain = next(f for f in render(inv).hosts["a"].files if f.path.endswith("chief-0.env")).data().decode()
    assert "CLOUD_ML_" not in plain


def test_an_image_pool_gets_the_arguments_after_its_args():
    base = BASE.replace("command: [python3, /opt/t.py]", "image: reg.local/t:1, args: [--epochs, '3']")
    t = trial_inventory(_inv(TUNE, base), 1, {"learning_rate": 0.5})
    assert t.pools[0].args == ("--epochs", "3", "--learning_rate=0.5")


def test_promote_writes_a_plain_inventory_with_the_trials_arguments(tmp_path):
    src = tmp_path / "study"
    src.mkdir()
    text = BASE + "files:\n  - {src: train.py, dest: /opt/t.py}\n" + TUNE
    inv = _inv(TUNE, BASE)
    out = promoted(
        text,
        inv.tune,
        {"learning_rate": 0.02, "optimizer": "sgd", "momentum": 0.9},
        number=7,
        why="succeeded",
        src_dir=src,
        out_dir=tmp_path / "elsewhere",
    )
    doc = yaml.safe_load(out)
    assert "tune" not in doc and doc["job"] == "sweep-p7"  # not the study's (its destroy would remove it)
    assert doc["pools"]["chief"]["command"][-3:] == ["--learning_rate=0.02", "--optimizer=sgd", "--momentum=0.9"]
    assert doc["files"][0]["src"] == "../study/train.py"
    assert out.startswith("# Trial 7 of study sweep")
    (src / "train.py").write_text("print(1)\n")
    (tmp_path / "elsewhere").mkdir()
    again = parse(out, tmp_path / "elsewhere" / "p.yaml", "p.yaml")  # a valid inventory, its file found
    assert again.tune is None and again.files[0].src == (src / "train.py").resolve()


def _model_dirs(inv) -> dict[str, str]:
    env = next(f for f in render(inv).hosts["a"].files if f.path.endswith("chief-0.env")).data().decode()
    return dict(line.split("=", 1) for line in env.splitlines() if line.startswith("AIP_"))


def test_each_trial_has_its_own_outputs_and_the_promoted_job_the_trials(tmp_path):
    """item 4: outputs: BASE gives trial N BASE/N/ (model, checkpoints, logs), as
    Vertex does; the promoted inventory's outputs are that trial's, not every trial's base."""
    base = BASE + "outputs: /data/runs\n"
    inv = _inv(TUNE, base)
    dirs = {n: _model_dirs(trial_inventory(inv, n, {"learning_rate": 0.01})) for n in (1, 2, 12)}
    assert dirs[2] == {
        "AIP_MODEL_DIR": '"/data/runs/2/model/"',
        "AIP_CHECKPOINT_DIR": '"/data/runs/2/checkpoints/"',
        "AIP_TENSORBOARD_LOG_DIR": '"/data/runs/2/logs/"',
    }
    assert len({d["AIP_MODEL_DIR"] for d in dirs.values()}) == 3
    out = promoted(
        base + TUNE, inv.tune, {"learning_rate": 0.01}, number=12, why="succeeded", src_dir=tmp_path, out_dir=tmp_path
    )
    doc = yaml.safe_load(out)
    assert doc["outputs"] == "/data/runs/12"
    assert _model_dirs(parse(out, tmp_path / "p.yaml", "p.yaml")) == dirs[12]
    # No outputs: none in the promoted one either.
    assert "outputs" not in yaml.safe_load(
        promoted(BASE + TUNE, inv.tune, {}, number=3, why="succeeded", src_dir=tmp_path, out_dir=tmp_path)
    )


def test_the_measurement_that_counts_and_the_best_trial():
    reports = (Report(1, 0.9), Report(2, 0.3), Report(3, float("nan")), Report(4, 0.5))
    metric = _inv().tune.metric
    assert measured(reports, metric, Measurement.LAST) == 0.5
    assert measured(reports, metric, Measurement.BEST) == 0.3
    assert measured((), metric, Measurement.LAST) is None
    rows = [
        TrialRow(1, (), TrialState.SUCCEEDED, 0.4),
        TrialRow(2, (), TrialState.STOPPED_EARLY, 0.1),
        TrialRow(3, (), TrialState.SUCCEEDED, 0.2),
        TrialRow(4, (), TrialState.FAILED, None),
    ]
    assert best(rows, metric).number == 3


@pytest.mark.parametrize(
    "argv, extra, want",
    [
        (["--epochs=3"], ["--batch_size=64"], ["--epochs=3", "--batch_size=64"]),
        # The flag the command has already: replaced where it is, never given twice.
        (["--batch_size=128", "--epochs=3"], ["--batch_size=64"], ["--batch_size=64", "--epochs=3"]),
        (["--batch_size", "128", "--epochs=3"], ["--batch_size=64"], ["--batch_size=64", "--epochs=3"]),
        (["--batch_size", "--epochs=3"], ["--batch_size=64"], ["--batch_size=64", "--epochs=3"]),
        (["--batch_size", "-1"], ["--batch_size=64"], ["--batch_size=64"]),
        (["--lr=1", "x", "--lr=2"], ["--lr=0.5", "--bs=8"], ["--lr=0.5", "x", "--lr=0.5", "--bs=8"]),
        # A longer name that starts the same is another flag.
        (["--batch_size_eval=9"], ["--batch_size=64"], ["--batch_size_eval=9", "--batch_size=64"]),
        (["--hidden_units=1 2"], ["--hidden_units=1024 512 256"], ["--hidden_units=1024 512 256"]),
        ([], ["--a=1"], ["--a=1"]),
    ],
)
def test_a_trials_flags_replace_the_same_flags(argv, extra, want):
    assert with_flags(argv, extra) == tuple(want)


def test_a_trial_replaces_a_flag_its_command_has():
    base = BASE.replace("command: [python3, /opt/t.py]", "command: [python3, -m, trainer.task, --batch_size=128, --x]")
    t = trial_inventory(_inv(TUNE, base), 2, {"learning_rate": 0.5, "batch_size": 32, "optimizer": "adam"})
    assert t.pools[0].command == (
        "python3",
        "-m",
        "trainer.task",
        "--batch_size=32",
        "--x",
        "--learning_rate=0.5",
        "--optimizer=adam",
    )


HOSTILE_CATEGORIES = [
    "1024 512 256",  # a real AI Platform config's hidden_units
    "it's",
    'say "hi"',
    "$HOME",
    "${PATH}",
    "100%",
    "%h %n",
    ";",
    "x; rm -rf /",
    "back\\slash\\",
    "tab\there",
    "`id`",
    "--flag",
    "",
    "ünïcode ✓",
]


def _yaml_str(s: str) -> str:
    return (
        yaml.safe_dump(s, default_style='"', width=1 << 30, allow_unicode=True).removesuffix("\n").removesuffix("\n...")
    )


@pytest.mark.parametrize("image", [False, True], ids=["command", "image"])
def test_a_categorical_value_is_any_text_and_reaches_the_trial_as_one_argument(image):
    """Each value is one argv element as systemd reads ExecStart= back (its parser's port in
    test_encode.py): no shell word splitting, no `$`/`%` expansion, quotes and backslashes kept."""
    values = ", ".join(_yaml_str(v) for v in HOSTILE_CATEGORIES)
    tune = TUNE.replace(
        "optimizer: {type: categorical, values: [adam, sgd]}", f"optimizer: {{type: categorical, values: [{values}]}}"
    )
    tune = tune.replace("when: {optimizer: [sgd]}", f"when: {{optimizer: [{_yaml_str(';')}]}}")
    base = BASE
    if image:
        base = BASE.replace("command: [python3, /opt/t.py]", "image: reg.local/t:1, args: [--epochs, '3']")
    inv = _inv(tune, base)
    opt = next(p for p in inv.tune.params if p.name == "optimizer")
    assert opt.values == tuple(HOSTILE_CATEGORIES)
    for n, value in enumerate(HOSTILE_CATEGORIES, 1):
        t = trial_inventory(inv, n, {"learning_rate": 0.01, "optimizer": value})
        files = {f.path: f for f in render(t).hosts["a"].files}
        unit = files[f"/etc/systemd/system/provision-sweep-t{n}-chief-0.service"].data().decode()
        (line,) = [ln for ln in unit.splitlines() if ln.startswith("ExecStart=")]
        argv = parse_exec(line[len("ExecStart=") :])
        assert argv[-2:] == ["--learning_rate=0.01", f"--optimizer={value}"], (value, line)
        head = ["/usr/bin/docker"] if image else ["python3", "/opt/t.py"]
        assert argv[: len(head)] == head
        if image:
            assert argv[-4:-2] == ["--epochs", "3"] and "reg.local/t:1" in argv
        env = dict(parse_env_file(files[f"/etc/provision/sweep-t{n}/chief-0.env"].data().decode()))
        assert env["CLOUD_ML_TRIAL_ID"] == str(n) and env["CLOUD_ML_HP_METRIC_TAG"] == "val_loss"
        assert not any(value and value in v for k, v in env.items() if len(value) > 3 and k != "CLUSTER_SPEC"), env
