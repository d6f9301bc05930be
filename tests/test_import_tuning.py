"""`provision import` of hyperparameter tuning jobs: the study becomes the inventory's `tune:`.

A Vertex AI HyperparameterTuningJob (its JSON as `describe` gives it, the `--config` YAML of
`gcloud ai hp-tuning-jobs create`, and a script with that command) and an AI Platform
TrainingInput with `hyperparameters` are imported through the CLI, as a user runs it; the
`tune:` read back from the file must be the expected mapping, every value one the model's
enums (core/tuning.py) know, and every field that did not map named in the notes. Then the
mistakes a study can hold, each one line naming the file and the key path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from provision.cli.app import main
from provision.core.tuning import Algorithm, EarlyStopping, Goal, Measurement, ParamType, Scale

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "import"


def run(*args: str, cwd: Path) -> tuple[int, str, str]:
    """The CLI in-process, from `cwd`, with stdout and stderr apart."""
    old = os.getcwd()
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    finally:
        os.chdir(old)
    return r.exit_code, r.stdout, r.stderr


def imported(tmp: Path, service: str, spec: str, *extra: str) -> tuple[dict[str, Any], str, str]:
    """Import SPEC (a name in tmp) to out.yaml; the file read back, its text and stderr."""
    code, _, err = run("import", service, spec, "-o", "out.yaml", "--force", *extra, cwd=tmp)
    assert code == 0, err
    assert "Traceback" not in err
    text = (tmp / "out.yaml").read_text()
    # Exit 0: import validated the file (with its example hosts, when none were given).
    if "--hosts" in extra:
        assert run("validate", "out.yaml", cwd=tmp)[0] == 0
    doc = yaml.safe_load(text)
    assert isinstance(doc, dict)
    check_schema(doc["tune"])
    return doc, text, err


def check_schema(tune: dict[str, Any]) -> None:
    """Every value is one the model's enums know; bounds and values as the schema says."""
    assert Goal(tune["metric"]["goal"]) and isinstance(tune["metric"]["name"], str)
    assert Algorithm(tune["algorithm"]) and EarlyStopping(tune["early_stopping"]) and Measurement(tune["measurement"])
    assert tune["max_trials"] >= 1 and tune["parallel_trials"] >= 1
    assert tune.get("max_failed_trials", 1) >= 1
    names = list(tune["parameters"])
    for i, (name, p) in enumerate(tune["parameters"].items()):
        t = ParamType(p["type"])
        assert Scale(p.get("scale", "linear")) and set(p) <= {"type", "min", "max", "scale", "values", "when"}
        if t in (ParamType.DOUBLE, ParamType.INTEGER):
            assert p["min"] <= p["max"] and "values" not in p
            kind = int if t is ParamType.INTEGER else float
            assert type(p["min"]) is kind and type(p["max"]) is kind, name
        elif t is ParamType.DISCRETE:
            assert p["values"] == sorted(set(p["values"])) and "scale" not in p
        else:
            assert all(isinstance(v, str) for v in p["values"]) and "scale" not in p
        for parent in p.get("when", {}):
            assert parent in names[:i], name  # a conditional parameter comes after its parent


def copy(tmp: Path, *names: str) -> None:
    for name in names:
        shutil.copy(FIXTURES / name, tmp / name)


def in_notes(text: str, path: str, why: str, section: str) -> None:
    """`path` is listed under `section` ("Not applied" / "Applied in part") with `why`."""
    part = text.split(f"# {section}", 1)[1].split("\n\n", 1)[0]
    lines = part.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"#   - {path}"))
    reason = " ".join(line.lstrip("# ").strip() for line in lines[at + 1 :] if line.startswith("#       "))
    assert why in reason.split(" #   - ")[0], (path, reason)


# --------------------------------------------------------------------------- Vertex AI

VERTEX_TUNE = {
    "metric": {"name": "val_loss", "goal": "minimize"},
    "parameters": {
        "learning_rate": {"type": "double", "min": 1e-05, "max": 0.001, "scale": "log"},
        "adam_beta2": {"type": "double", "min": 0.9, "max": 0.9999},
        "num_layers": {"type": "integer", "min": 1, "max": 4},
        "batch_size": {"type": "discrete", "values": [16, 32, 64]},
        "optimizer": {"type": "categorical", "values": ["adam", "sgd"]},
        "momentum": {"type": "double", "min": 0.0, "max": 0.99, "when": {"optimizer": ["sgd"]}},
        "schedule": {"type": "categorical", "values": ["constant", "cosine"], "when": {"optimizer": ["sgd"]}},
        "decay_steps": {"type": "integer", "min": 1000, "max": 10000, "scale": "log", "when": {"schedule": ["cosine"]}},
    },
    "algorithm": "bayesian",
    "max_trials": 20,
    "parallel_trials": 4,
    "early_stopping": "median",
    "measurement": "best",
}


def test_vertex_tuning_job_json(tmp_path: Path) -> None:
    """The JSON `gcloud ai hp-tuning-jobs describe` gives: the study is tune:, the trial job
    the pools, no task.trial; what did not map is named, output-only fields too."""
    copy(tmp_path, "vertex_hptuning.json", "hosts-v100.yaml")
    doc, text, err = imported(tmp_path, "vertex", "vertex_hptuning.json", "--hosts", "hosts-v100.yaml")
    assert doc["tune"] == VERTEX_TUNE
    assert list(doc["tune"]["parameters"]) == list(VERTEX_TUNE["parameters"])  # the source's order
    assert "max_failed_trials" not in doc["tune"]  # maxFailedTrialCount 0: the service decided
    assert doc["tf_config"] == {"chief_name": "chief"}
    spec = json.loads((FIXTURES / "vertex_hptuning.json").read_text())
    assert doc["job_spec"] == spec["trialJobSpec"]
    assert doc["job"] == "bert-finetune-hpt" and list(doc["pools"]) == ["chief"]
    assert "(chief 1); tune: 8 parameters, up to 20 trials; 12 fields not applied" in err
    assert "Then: provision validate FILE && provision tune FILE" in text

    changed, dropped = "Applied in part:", "Not applied, and why:"
    in_notes(text, "studySpec.parameters[1].scaleType: UNIT_REVERSE_LOG_SCALE", "scale: linear", changed)
    in_notes(text, "maxFailedTrialCount: 0", "leaves max_failed_trials out", changed)
    in_notes(text, "studySpec.decayCurveStoppingSpec", "early_stopping: median, the closest rule", changed)
    in_notes(text, "studySpec.metrics[1]", "optimizes one metric, the first (val_loss)", dropped)
    in_notes(text, "studySpec.parameters[4].conditionalParameterSpecs[1]", "no first value to try", dropped)
    for key in ("name", "state", "createTime", "trials"):
        in_notes(text, f"{key}: ", "written by the service", dropped)
    in_notes(text, "labels", "Google Cloud resource labels", dropped)


GCLOUD_TUNE = {
    "metric": {"name": "val_loss", "goal": "minimize"},
    "parameters": {
        "learning_rate": {"type": "double", "min": 0.0001, "max": 1.0, "scale": "log"},
        "layers": {"type": "integer", "min": 1, "max": 4},
        "batch_size": {"type": "discrete", "values": [32, 64, 128]},
        "optimizer": {"type": "categorical", "values": ["adam", "sgd"]},
        "momentum": {"type": "double", "min": 0.0, "max": 0.99, "when": {"optimizer": ["sgd"]}},
    },
    "algorithm": "bayesian",
    "max_trials": 8,
    "parallel_trials": 2,
    "max_failed_trials": 5,
    "early_stopping": "median",
    "measurement": "last",
}


def test_gcloud_config_yaml(tmp_path: Path) -> None:
    """The --config file of `gcloud ai hp-tuning-jobs create`, imported on its own."""
    copy(tmp_path, "hp_tuning_config.yaml")
    doc, text, _ = imported(tmp_path, "vertex", "hp_tuning_config.yaml")
    assert doc["tune"] == GCLOUD_TUNE
    assert doc["job"] == "mnist-hpt-from-config"
    assert {role: p["replicas"] for role, p in doc["pools"].items()} == {"chief": 1, "worker": 2}
    assert doc["job_spec"] == yaml.safe_load((FIXTURES / "hp_tuning_config.yaml").read_text())["trialJobSpec"]
    assert "studySpec" not in text.split("# Not applied", 1)[1]  # every study field mapped


def test_gcloud_hp_tuning_jobs_command(tmp_path: Path) -> None:
    """The script: --config beside it, the flags over it (trial counts, the algorithm, the name)."""
    copy(tmp_path, "hp_tuning.sh", "hp_tuning_config.yaml")
    doc, text, _ = imported(tmp_path, "vertex", "hp_tuning.sh")
    want = {**GCLOUD_TUNE, "algorithm": "random", "max_trials": 12, "parallel_trials": 3}
    assert doc["tune"] == want
    assert doc["job"] == "mnist-hpt" and doc["tf_config"] == {"chief_name": "chief"}
    assert "from a `gcloud ai hp-tuning-jobs create` command (hp_tuning.sh, line 7)" in " ".join(
        line.lstrip("# ") for line in text.splitlines()[:3]
    )
    in_notes(text, "--region: us-central1", "your hosts are where they are", "Not applied, and why:")
    in_notes(text, "--display-name: mnist_hpt", "job mnist-hpt", "Applied in part:")


# --------------------------------------------------------------------------- AI Platform Training

AIP_TUNE = {
    "metric": {"name": "training/hptuning/metric", "goal": "minimize"},
    "parameters": {
        "learning_rate": {"type": "double", "min": 0.0001, "max": 0.1, "scale": "log"},
        "dropout": {"type": "double", "min": 0.1, "max": 0.5},
        "hidden_units": {"type": "integer", "min": 64, "max": 1024},
        "batch_size": {"type": "discrete", "values": [32, 64, 128, 256]},
        "optimizer": {"type": "categorical", "values": ["adam", "rmsprop", "sgd"]},
    },
    "algorithm": "random",
    "max_trials": 30,
    "parallel_trials": 5,
    "max_failed_trials": 4,
    "early_stopping": "median",
    "measurement": "last",
}


def test_ai_platform_hyperparameters(tmp_path: Path) -> None:
    """A job with trainingInput.hyperparameters (JSON): no metric tag, so cloudml-hypertune's
    default name; early stopping on; resumePreviousJobId named as not applied."""
    copy(tmp_path, "aip_hptuning.json")
    doc, text, _ = imported(tmp_path, "ai-platform", "aip_hptuning.json")
    assert doc["tune"] == AIP_TUNE
    ti = json.loads((FIXTURES / "aip_hptuning.json").read_text())["trainingInput"]
    assert doc["job_spec"] == ti  # hyperparameters included: AI Platform's TF_CONFIG job had them
    assert doc["tf_config"] == {"chief_name": "master"}
    in_notes(
        text,
        "trainingInput.hyperparameters.resumePreviousJobId",
        "provision tune resumes its own study",
        "Not applied, and why:",
    )
    in_notes(text, "trainingInput.hyperparameters.params[1].scaleType", "scale: linear", "Applied in part:")
    assert "trainingInput.hyperparameters: " not in text  # the study is mapped, not noted whole


def test_ai_platform_census_and_defaults(tmp_path: Path) -> None:
    """The census job's study; and a bare one: goal MAXIMIZE, one trial, one at a time."""
    copy(tmp_path, "census_hptuning.yaml")
    doc, _, _ = imported(tmp_path, "ai-platform", "census_hptuning.yaml")
    assert doc["tune"] == {
        "metric": {"name": "accuracy", "goal": "maximize"},
        "parameters": {"learning-rate": {"type": "double", "min": 0.0001, "max": 0.1, "scale": "log"}},
        "algorithm": "bayesian",
        "max_trials": 4,
        "parallel_trials": 2,
        "early_stopping": "none",
        "measurement": "last",
    }
    (tmp_path / "bare.yaml").write_text(
        "scaleTier: BASIC\npythonModule: trainer.task\nhyperparameters:\n"
        "  params: [{parameterName: units, type: INTEGER, minValue: 8, maxValue: 64}]\n"
    )
    doc, _, _ = imported(tmp_path, "ai-platform", "bare.yaml")
    assert doc["tune"] == {
        "metric": {"name": "training/hptuning/metric", "goal": "maximize"},
        "parameters": {"units": {"type": "integer", "min": 8, "max": 64}},
        "algorithm": "bayesian",
        "max_trials": 1,
        "parallel_trials": 1,
        "early_stopping": "none",
        "measurement": "last",
    }


# --------------------------------------------------------------------------- each field's mapping


def vertex_job(study: dict[str, Any], **top: Any) -> str:
    job = {
        "displayName": "t",
        "maxTrialCount": 4,
        "studySpec": {
            "metrics": [{"metricId": "m", "goal": "MAXIMIZE"}],
            "parameters": [{"parameterId": "n", "integerValueSpec": {"minValue": 1, "maxValue": 3}}],
            **study,
        },
        "trialJobSpec": {"workerPoolSpecs": [{"replicaCount": 1, "containerSpec": {"imageUri": "r/t:1"}}]},
        **top,
    }
    return json.dumps(job)


@pytest.mark.parametrize(
    "study,top,want,note",
    [
        ({"algorithm": "GRID_SEARCH"}, {}, {"algorithm": "grid"}, None),
        ({"algorithm": "RANDOM_SEARCH"}, {}, {"algorithm": "random"}, None),
        ({"measurementSelectionType": "LAST_MEASUREMENT"}, {}, {"measurement": "last"}, None),
        ({"medianAutomatedStoppingSpec": {}}, {}, {"early_stopping": "median"}, None),
        (
            {"medianAutomatedStoppingSpec": {"useElapsedDuration": True}},
            {},
            {"early_stopping": "median"},
            "compares trials at the same step, not time",
        ),
        ({"convexAutomatedStoppingSpec": {"maxStepCount": "100"}}, {}, {"early_stopping": "median"}, "closest rule"),
        (
            {},
            {"maxFailedTrialCount": "2", "parallelTrialCount": "2"},
            {"max_failed_trials": 2, "parallel_trials": 2},
            None,
        ),
        ({"observationNoise": "HIGH"}, {}, {}, "has no noise setting"),
    ],
)
def test_vertex_study_fields(
    study: dict[str, Any], top: dict[str, Any], want: dict[str, Any], note: str | None, tmp_path: Path
) -> None:
    (tmp_path / "t.json").write_text(vertex_job(study, **top))
    doc, text, _ = imported(tmp_path, "vertex", "t.json")
    base = {"algorithm": "bayesian", "max_trials": 4, "parallel_trials": 1, "early_stopping": "none"}
    assert {k: doc["tune"].get(k) for k in {**base, **want}} == {**base, **want}
    if note is not None:
        assert note in " ".join(line.lstrip("# ") for line in text.split("# Not applied", 1)[-1].splitlines())
    if "maxFailedTrialCount" not in top:
        assert "max_failed_trials" not in doc["tune"] and "maxFailedTrialCount" not in text


@pytest.mark.parametrize(
    "prefix,outputs,why",
    [
        ("/data/runs/", "/data/runs", "outputs: /data/runs: AIP_MODEL_DIR, AIP_CHECKPOINT_DIR"),
        ("gs://b/hpt", "/data/t", "trial N gets AIP_MODEL_DIR=/data/t/N/model/"),
    ],
)
def test_a_tuning_jobs_base_output_directory_is_outputs(prefix: str, outputs: str, why: str, tmp_path: Path) -> None:
    """Issue 39 item 4: baseOutputDirectory is `outputs:`, so trial N writes BASE/N/model/
    as on Vertex; never one fixed AIP_MODEL_DIR that every trial would overwrite."""
    job = json.loads(vertex_job({}))
    job["trialJobSpec"]["baseOutputDirectory"] = {"outputUriPrefix": prefix}
    (tmp_path / "t.json").write_text(json.dumps(job))
    doc, text, _ = imported(tmp_path, "vertex", "t.json")
    assert doc["outputs"] == outputs
    assert "AIP_MODEL_DIR" not in (doc.get("env") or {})
    in_notes(text, "trialJobSpec.baseOutputDirectory", why, "Applied in part:")


def test_a_plain_jobs_gs_base_output_directory_stays_the_env_vertex_sets(tmp_path: Path) -> None:
    """One job (no study): a gs:// base is the three variables as Vertex sets them (the
    trainer writes to Cloud Storage); a directory on the hosts is `outputs:`."""
    job = json.loads(vertex_job({}))
    spec = job["trialJobSpec"]
    for prefix, env, outputs in (("gs://b/x", {"AIP_MODEL_DIR": "gs://b/x/model/"}, None), ("/data/x", {}, "/data/x")):
        spec["baseOutputDirectory"] = {"outputUriPrefix": prefix}
        (tmp_path / "c.json").write_text(json.dumps({"displayName": "c", "jobSpec": spec}))
        code, _, err = run("import", "vertex", "c.json", "-o", "c.yaml", "--force", cwd=tmp_path)
        assert code == 0, err
        doc = yaml.safe_load((tmp_path / "c.yaml").read_text())
        assert doc.get("outputs") == outputs
        assert {k: v for k, v in (doc.get("env") or {}).items() if k == "AIP_MODEL_DIR"} == env


# --------------------------------------------------------------------------- --trial


@pytest.mark.parametrize(
    "service,name,alone",
    [
        ("vertex", "vertex_hptuning.json", "import its trialJobSpec alone (a CustomJobSpec) with --trial"),
        ("ai-platform", "census_hptuning.yaml", "import it without hyperparameters with --trial"),
        ("vertex", "hp_tuning.sh", "import its trialJobSpec alone (a CustomJobSpec) with --trial"),
    ],
)
def test_trial_is_refused_for_a_tuning_job(service: str, name: str, alone: str, tmp_path: Path) -> None:
    copy(tmp_path, name, "hp_tuning_config.yaml")
    code, out, err = run("import", service, name, "--trial", "3", "-o", "out.yaml", cwd=tmp_path)
    assert code == 1 and out == "" and not (tmp_path / "out.yaml").exists()
    assert err == (
        f"Error: --trial: {name} is a hyperparameter tuning job: its study becomes tune:, and `provision tune` "
        f"numbers each trial; for one trial as a plain job, {alone}\n"
    )


# --------------------------------------------------------------------------- mistakes: one line each


def aip(params: str, extra: str = "") -> str:
    return f"scaleTier: BASIC\npythonModule: m\nhyperparameters:\n  params: {params}\n{extra}"


def vparams(params: list[dict[str, Any]], **study: Any) -> str:
    return vertex_job({"parameters": params, **study})


ERRORS = [
    (
        "ai-platform",
        "t.yaml",
        aip("[{parameterName: lr, minValue: 0.1, maxValue: 1}]"),
        "t.yaml: hyperparameters.params[0].type: missing: the parameter's type (DOUBLE, INTEGER, CATEGORICAL, DISCRETE)",
    ),
    (
        "ai-platform",
        "t.yaml",
        aip("[{parameterName: lr, type: FLOAT, minValue: 0.1, maxValue: 1}]"),
        "t.yaml: hyperparameters.params[0].type: expected one of DOUBLE, INTEGER, CATEGORICAL, DISCRETE, got 'FLOAT'",
    ),
    (
        "ai-platform",
        "t.yaml",
        aip("[{parameterName: lr, type: DOUBLE, minValue: 1, maxValue: 0.1}]"),
        "t.yaml: hyperparameters.params[0].minValue: 1.0 is above maxValue, 0.1",
    ),
    (
        "ai-platform",
        "t.yaml",
        aip("[{parameterName: lr, type: DOUBLE, minValue: 0, maxValue: 1, scaleType: UNIT_LOG_SCALE}]"),
        "t.yaml: hyperparameters.params[0].minValue: 0.0: a log scale needs minValue above 0",
    ),
    (
        "ai-platform",
        "t.yaml",
        aip("[{parameterName: n, type: INTEGER, minValue: 1.5, maxValue: 4}]"),
        "t.yaml: hyperparameters.params[0].minValue: expected a whole number, got 1.5",
    ),
    (
        "ai-platform",
        "t.yaml",
        aip("[{parameterName: b, type: DISCRETE, discreteValues: [64, 32]}]"),
        "t.yaml: hyperparameters.params[0].discreteValues[1]: 32 after 64: the values must be increasing",
    ),
    (
        "ai-platform",
        "t.yaml",
        aip("[{parameterName: o, type: CATEGORICAL}]"),
        "t.yaml: hyperparameters.params[0].categoricalValues: missing: a categorical parameter needs a non-empty list of values",
    ),
    (
        "ai-platform",
        "t.yaml",
        aip("[{parameterName: lr, type: DOUBLE, minValue: 0.1, maxValue: 1}]", "  algorithm: GRID_SEARCH\n"),
        "t.yaml: hyperparameters.algorithm: GRID_SEARCH needs integer, categorical or discrete parameters; 'lr' is a double",
    ),
    (
        "ai-platform",
        "t.yaml",
        aip("[{parameterName: n, type: INTEGER, minValue: 1, maxValue: 2}]", "  max_trials: 3\n"),
        "t.yaml: hyperparameters.max_trials: write the key in camelCase, 'maxTrials', as the API and gcloud --config do",
    ),
    (
        "vertex",
        "t.json",
        vparams([{"parameterId": "lr", "scaleType": "UNIT_LOG_SCALE"}]),
        "t.json: studySpec.parameters[0]: expected one of doubleValueSpec, integerValueSpec, categoricalValueSpec, discreteValueSpec: the parameter's type",
    ),
    (
        "vertex",
        "t.json",
        vparams([{"parameterId": "n", "integerValueSpec": {"minValue": "5", "maxValue": "2"}}]),
        "t.json: studySpec.parameters[0].integerValueSpec.minValue: 5 is above maxValue, 2",
    ),
    (
        "vertex",
        "t.json",
        vparams(
            [{"parameterId": "lr", "doubleValueSpec": {"minValue": -1, "maxValue": 1}, "scaleType": "UNIT_LOG_SCALE"}]
        ),
        "t.json: studySpec.parameters[0].doubleValueSpec.minValue: -1.0: a log scale needs minValue above 0",
    ),
    (
        "vertex",
        "t.json",
        vparams([{"parameterId": "lr", "doubleValueSpec": {"minValue": 0.1}}]),
        "t.json: studySpec.parameters[0].doubleValueSpec.maxValue: missing: a double parameter needs minValue and maxValue",
    ),
    (
        "vertex",
        "t.json",
        vparams(
            [
                {
                    "parameterId": "opt",
                    "categoricalValueSpec": {"values": ["adam", "sgd"]},
                    "conditionalParameterSpecs": [
                        {
                            "parameterSpec": {"parameterId": "m", "doubleValueSpec": {"minValue": 0, "maxValue": 1}},
                            "parentCategoricalValues": {"values": ["rmsprop"]},
                        }
                    ],
                }
            ]
        ),
        "t.json: studySpec.parameters[0].conditionalParameterSpecs[0].parentCategoricalValues.values[0]: 'rmsprop' is not one of 'opt''s values (adam, sgd)",
    ),
    (
        "vertex",
        "t.json",
        vparams(
            [
                {
                    "parameterId": "opt",
                    "categoricalValueSpec": {"values": ["adam", "sgd"]},
                    "conditionalParameterSpecs": [
                        {
                            "parameterSpec": {"parameterId": "m", "doubleValueSpec": {"minValue": 0, "maxValue": 1}},
                            "parentIntValues": {"values": ["1"]},
                        }
                    ],
                }
            ]
        ),
        "t.json: studySpec.parameters[0].conditionalParameterSpecs[0]: expected parentCategoricalValues: the values of categorical parameter 'opt' it is for, got parentIntValues",
    ),
    (
        "vertex",
        "t.json",
        vparams(
            [
                {"parameterId": "n", "integerValueSpec": {"minValue": 1, "maxValue": 3}},
                {"parameterId": "n", "discreteValueSpec": {"values": [1, 2]}},
            ]
        ),
        "t.json: studySpec.parameters[1].parameterId: 'n' is a parameter already",
    ),
    (
        "vertex",
        "t.json",
        vertex_job({"metrics": [{"metricId": "m", "goal": "BIGGER"}]}),
        "t.json: studySpec.metrics[0].goal: expected one of MAXIMIZE, MINIMIZE, got 'BIGGER'",
    ),
    (
        "vertex",
        "t.json",
        vertex_job({"metrics": []}),
        "t.json: studySpec.metrics: missing: the metric the study optimizes ({metricId, goal})",
    ),
    (
        "vertex",
        "t.json",
        vertex_job({"algorithm": "HILL_CLIMBING"}),
        "t.json: studySpec.algorithm: expected one of ALGORITHM_UNSPECIFIED, GRID_SEARCH, RANDOM_SEARCH, got 'HILL_CLIMBING'",
    ),
    (
        "vertex",
        "t.json",
        vertex_job({}, maxTrialCount=0),
        "t.json: maxTrialCount: expected an integer >= 1, got 0",
    ),
    (
        "vertex",
        "t.json",
        json.dumps({"studySpec": {}, "maxTrialCount": 1}),
        "t.json: (top level): missing 'trialJobSpec' (the CustomJobSpec every trial runs)",
    ),
    (
        "vertex",
        "t.sh",
        "gcloud ai hp-tuning-jobs create --region=r --display-name=x --max-trial-count=4\n",
        "t.sh:1: the command has no --config: gcloud reads the study and the trial job from it",
    ),
    (
        "vertex",
        "t.sh",
        "gcloud ai hp-tuning-jobs create --config=c.yaml \\\n  --algorithm=hill-climbing\n",
        "t.sh:2: --algorithm: expected one of algorithm-unspecified, grid-search, random-search, got 'hill-climbing'",
    ),
]


@pytest.mark.parametrize("service,name,text,message", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_bad_study_one_line(service: str, name: str, text: str, message: str, tmp_path: Path) -> None:
    (tmp_path / name).write_text(text)
    (tmp_path / "c.yaml").write_text(vertex_job({}))
    code, out, err = run("import", service, name, "-o", "out.yaml", cwd=tmp_path)
    assert code == 1
    assert err == f"Error: {message}\n"
    assert out == "" and not (tmp_path / "out.yaml").exists()
