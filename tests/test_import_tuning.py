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
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from clirun import run
from provision.core.tuning import Algorithm, EarlyStopping, Goal, Measurement, ParamType, Scale

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "import"


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
            assert p["values"] and all(isinstance(v, str) for v in p["values"]) and "scale" not in p
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
    """item 4: baseOutputDirectory is `outputs:`, so trial N writes BASE/N/model/
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


# --------------------------------------------------------------------------- AI Platform gcloud scripts

# AI Platform Training's tuning examples: a hptuning_config.yaml (a Job: trainingInput with
# the study) and the gcloud command that says what runs. A real config's hidden_units are
# whole strings with spaces.
HPTUNING_CONFIG = """\
trainingInput:
  hyperparameters:
    goal: MAXIMIZE
    hyperparameterMetricTag: accuracy
    maxTrials: 6
    maxParallelTrials: 2
    enableTrialEarlyStopping: True
    params:
    - parameterName: batch_size
      type: DISCRETE
      discreteValues: [64, 128, 256]
    - parameterName: hidden_units
      type: CATEGORICAL
      categoricalValues: ['1024 512 256', '512 256 128', '256 128 64']
    - parameterName: learning_rate
      type: DOUBLE
      minValue: 0.0001
      maxValue: 0.1
      scaleType: UNIT_LOG_SCALE
"""
AIP_SCRIPT_TUNE = {
    "metric": {"name": "accuracy", "goal": "maximize"},
    "parameters": {
        "batch_size": {"type": "discrete", "values": [64, 128, 256]},
        "hidden_units": {"type": "categorical", "values": ["1024 512 256", "512 256 128", "256 128 64"]},
        "learning_rate": {"type": "double", "min": 0.0001, "max": 0.1, "scale": "log"},
    },
    "algorithm": "bayesian",
    "max_trials": 6,
    "parallel_trials": 2,
    "early_stopping": "median",
    "measurement": "last",
}
PY = "/opt/venvs/census/bin/python"


def aip_project(tmp: Path, script: str, *, setup_py: bool = True) -> None:
    """A trainer package as the examples lay it out: trainer/ (and setup.py) beside the script."""
    (tmp / "trainer").mkdir()
    (tmp / "trainer" / "__init__.py").write_text("")
    (tmp / "trainer" / "task.py").write_text("import sys\nprint(sys.argv)\n")
    if setup_py:
        (tmp / "setup.py").write_text("from setuptools import setup\nsetup(name='trainer', packages=['trainer'])\n")
    (tmp / "hptuning_config.yaml").write_text(HPTUNING_CONFIG)
    (tmp / "train.sh").write_text(script)


AIP_SCRIPTS = [
    (  # the AI Platform examples' form: JOB from a variable, flags with spaces, user args after --
        "ai-platform, --config, args after --",
        """#!/bin/bash
JOB_NAME=census
REGION=us-central1
gcloud ai-platform jobs submit training $JOB_NAME \\
  --module-name trainer.task \\
  --package-path trainer/ \\
  --region $REGION \\
  --scale-tier basic \\
  --runtime-version 2.11 \\
  --python-version 3.7 \\
  --config hptuning_config.yaml \\
  -- \\
  --batch_size=128 --train-steps 1000
""",
        {"chief": 1},
        (PY, "-m", "trainer.task", "--batch_size=128", "--train-steps", "1000"),
        True,
    ),
    (
        "ai-platform, --config, no args",
        "gcloud ai-platform jobs submit training census --module-name=trainer.task --package-path=trainer "
        "--config=hptuning_config.yaml --runtime-version=2.11\n",
        {"chief": 1},
        (PY, "-m", "trainer.task"),
        True,
    ),
    (  # the older command group, beta, and a job dir
        "ml-engine, --config, args after --",
        """gcloud beta ml-engine jobs submit training census \\
    --job-dir gs://bucket/census --module-name trainer.task --package-path ./trainer \\
    --config hptuning_config.yaml --runtime-version 2.11 --stream-logs \\
    -- --hidden_units='64 32' --epochs 3
""",
        {"chief": 1},
        (PY, "-m", "trainer.task", "--hidden_units=64 32", "--epochs", "3", "--job-dir", "gs://bucket/census"),
        True,
    ),
    (
        "ml-engine, --config, no args",
        "gcloud ml-engine jobs submit training census --module-name trainer.task --package-path trainer "
        "--config hptuning_config.yaml --runtime-version 2.11\n",
        {"chief": 1},
        (PY, "-m", "trainer.task"),
        False,
    ),
    (  # CUSTOM from flags: the TrainingInput importer's pools
        "ai-platform, custom tier from flags",
        """gcloud ai-platform jobs submit training census --config hptuning_config.yaml \\
  --module-name trainer.task --package-path trainer --runtime-version 2.11 \\
  --scale-tier custom --master-machine-type n1-standard-8 \\
  --master-accelerator count=2,type=nvidia-tesla-v100 \\
  --worker-machine-type n1-standard-8 --worker-count 2 --worker-accelerator type=nvidia-tesla-v100 \\
  --parameter-server-machine-type n1-highmem-8 --parameter-server-count 1 \\
  -- --batch_size 128
""",
        {"chief": 1, "worker": 2, "ps": 1},
        (PY, "-m", "trainer.task", "--batch_size", "128"),
        True,
    ),
]


@pytest.mark.parametrize("script,pools,command,setup_py", [a[1:] for a in AIP_SCRIPTS], ids=[a[0] for a in AIP_SCRIPTS])
def test_ai_platform_gcloud_script(
    script: str, pools: dict[str, int], command: tuple[str, ...], setup_py: bool, tmp_path: Path
) -> None:
    """`gcloud ai-platform|ml-engine jobs submit training` with --config: the study from the
    config, what runs from the flags, the user arguments after `--` kept; the package pushed
    with files:, PYTHONPATH its parent, setup.py (when there) installed by the setup block."""
    aip_project(tmp_path, script, setup_py=setup_py)
    doc, text, err = imported(tmp_path, "ai-platform", "train.sh")
    assert doc["tune"] == AIP_SCRIPT_TUNE
    assert doc["job"] == "census"
    assert {role: p["replicas"] for role, p in doc["pools"].items()} == pools
    for p in doc["pools"].values():
        assert tuple(p["command"]) == command
        assert p["env"] == {"PYTHONPATH": "/opt/census"}
    want_files = [{"src": "trainer/", "dest": "/opt/census/trainer/"}]
    if setup_py:
        want_files.append({"src": "setup.py", "dest": "/opt/census/setup.py"})
    assert doc["files"] == want_files
    setup = [line.strip("# -") for line in text.splitlines() if line.startswith("#     - ")]
    assert setup[0] == "python3 -m venv /opt/venvs/census"
    assert "/opt/venvs/census/bin/pip install 'tensorflow~=2.11.0'" in setup
    assert ("/opt/venvs/census/bin/pip install /opt/census" in setup) == setup_py
    assert doc["job_spec"]["pythonModule"] == "trainer.task"
    assert doc["job_spec"]["hyperparameters"]["maxTrials"] == 6
    assert doc["job_spec"].get("args", []) == list(command[3:]) or "--job-dir" in command
    assert "jobs submit training` command (train.sh, line" in " ".join(text.splitlines()[:2])
    in_notes(text, "--package-path: trainer/", "files: pushes it to /opt/census/trainer/", "Applied in part:")
    assert "Traceback" not in err


def test_ai_platform_gcloud_script_details(tmp_path: Path) -> None:
    """gcloud's flag spellings: JOB only the shell can work out (a date in it), --flag=value,
    accelerators and the chief rule, a container job, notes named by their flags."""
    aip_project(
        tmp_path,
        """JOB_NAME=census_$(date +%Y%m%d_%H%M%S)
gcloud --project=p ai-platform jobs submit training "$JOB_NAME" --config=hptuning_config.yaml \\
  --scale-tier=CUSTOM --master-machine-type=n1-standard-4 --master-image-uri=gcr.io/p/t:1 \\
  --use-chief-in-tf-config=true --region=us-central1 --labels=team=a -- --batch_size=32
""",
    )
    doc, text, _ = imported(tmp_path, "ai-platform", "train.sh")
    assert doc["job"] == "train"  # the script's name: JOB needs the shell
    assert doc["pools"]["chief"]["image"] == "gcr.io/p/t:1"
    assert doc["pools"]["chief"]["args"] == ["--batch_size=32"]
    assert doc["tf_config"] == {"chief_name": "chief"}
    assert "files" not in doc and "setup:" not in text
    in_notes(text, "JOB: ${JOB_NAME}", "only the shell can work out the whole name: job train", "Applied in part:")
    in_notes(text, "--region: us-central1", "your hosts are where they are", "Not applied, and why:")
    in_notes(text, "--labels: team=a", "Google Cloud resource labels", "Not applied, and why:")
    in_notes(text, "--project: p", "the Google Cloud project the job ran in", "Not applied, and why:")
    in_notes(
        text, "--master-machine-type: n1-standard-4", "the hosts you list are the machines", "Not applied, and why:"
    )


def test_a_trial_of_an_imported_script_replaces_its_flags(tmp_path: Path) -> None:
    """A trial's parameters replace the same flags of the user arguments (batch_size given
    as 128 after `--`): the trainer sees the trial's value once; a categorical value with
    spaces is one argument."""
    from provision.inventory.inventory import parse
    from provision.inventory.trial import trial_inventory

    aip_project(tmp_path, AIP_SCRIPTS[0][1])
    copy(tmp_path, "hosts-cpu.yaml")
    imported(tmp_path, "ai-platform", "train.sh", "--hosts", "hosts-cpu.yaml")
    inv = parse((tmp_path / "out.yaml").read_text(), tmp_path / "out.yaml", "out.yaml")
    t = trial_inventory(inv, 2, {"batch_size": 64, "hidden_units": "1024 512 256", "learning_rate": 0.01})
    assert t.pools[0].command == (
        PY,
        "-m",
        "trainer.task",
        "--batch_size=64",
        "--train-steps",
        "1000",
        "--hidden_units=1024 512 256",
        "--learning_rate=0.01",
    )


AIP_SCRIPT_ERRORS = [
    (
        "gcloud ai-platform jobs submit training --module-name trainer.task --package-path trainer\n",
        "train.sh:1: the command has no JOB (gcloud's first argument: the job's name)",
    ),
    (
        "gcloud ai-platform jobs submit training j --config hptuning_config.yaml\n",
        "train.sh:1: the command has neither --module-name (with --package-path) nor --master-image-uri, and "
        "hptuning_config.yaml neither trainingInput.pythonModule nor masterConfig.imageUri: what does this job run?",
    ),
    (
        "gcloud ai-platform jobs submit training j --module-name trainer.task\n",
        "train.sh:1: --module-name without --package-path or --packages: where is the module's code?",
    ),
    (
        "gcloud ai-platform jobs submit training j --module-name m --package-path nowhere\n",
        "train.sh:1: --package-path: no such directory: nowhere (looked beside the script and in the current directory)",
    ),
    (
        "gcloud ai-platform jobs submit training j --module-name m --package-path trainer \\\n  --scale-tier huge\n",
        "train.sh:2: --scale-tier: expected one of custom, basic, basic-gpu, basic-tpu, standard-1, premium-1, got 'huge'",
    ),
    (
        "gcloud ai-platform jobs submit training j --module-name m --package-path trainer --worker-count many\n",
        "train.sh:1: --worker-count: expected an integer, got 'many'",
    ),
    (
        "gcloud ai-platform jobs submit training j --module-name m --package-path trainer --master-accelerator count=2\n",
        "train.sh:1: --master-accelerator: missing type= (such as type=nvidia-tesla-v100), got 'count=2'",
    ),
    (
        "gcloud ai-platform jobs submit training j --module-name m --package-path trainer --config bare.yaml\n",
        "bare.yaml: (top level): gcloud's --config is a Job: put these keys under trainingInput:",
    ),
    (
        "gcloud ai custom-jobs create --region=r --worker-pool-spec=machine-type=a,container-image-uri=b\n",
        "train.sh:1: `gcloud ai custom-jobs create` is a Vertex AI job: use `provision import vertex`",
    ),
    (
        "gcloud storage ls gs://bucket\n",
        "train.sh: neither a TrainingInput / job with trainingInput (JSON or YAML) nor a shell script with a "
        "`gcloud ai-platform jobs submit training` command",
    ),
    (
        "gcloud ai-platform jobs submit training a --module-name m --package-path trainer\n"
        "gcloud ml-engine jobs submit training b --module-name m --package-path trainer\n",
        "train.sh: 2 `gcloud ... training` commands (lines 1, 2): import one at a time (one per file)",
    ),
    (  # what only the shell can work out: the flag and its value, as the script writes them
        "gcloud ai-platform jobs submit training j --module-name m --package-path=$(git rev-parse --show-toplevel)/t\n",
        "train.sh:1: --package-path: cannot read $(git rev-parse --show-toplevel)/t: $(git rev-parse "
        "--show-toplevel): only the shell can work this out: write the value (or set a variable above the command)",
    ),
    (
        'gcloud ai-platform jobs submit training j --module-name m --package-path "$TOP/trainer"\n',
        "train.sh:1: --package-path: cannot read ${TOP}/trainer: $TOP is not set in this file or in the "
        "environment: set it above the command, or write the value",
    ),
    (
        "gcloud ai-platform jobs submit training j --package-path trainer --module-name=`cat m.txt`\n",
        "train.sh:1: --module-name: cannot read `cat m.txt`: `cat m.txt`: only the shell can work this out",
    ),
]


@pytest.mark.parametrize(
    "package",
    ["$(pwd)/trainer", "${PWD}/trainer", "$PWD/trainer/", '"$(pwd)/trainer"', "`pwd`/trainer", "$(pwd -P)/trainer"],
)
@pytest.mark.parametrize("eq", ["=", " "])
def test_an_ai_platform_script_names_its_package_from_its_own_directory(package: str, eq: str, tmp_path: Path) -> None:
    """`--package-path=$(pwd)/trainer` (or $PWD, ${PWD}), as real submit scripts write it:
    the script's directory, wherever `provision import` runs from; a shell part of a flag
    that does not matter (--labels) is a note, as written."""
    proj = tmp_path / "proj"
    proj.mkdir()
    aip_project(
        proj,
        f"gcloud ai-platform jobs submit training census --module-name=trainer.task --package-path{eq}{package} "
        "--config hptuning_config.yaml --runtime-version 2.11 --labels=team=$(whoami)\n",
    )
    doc, text, _ = imported(tmp_path, "ai-platform", "proj/train.sh")
    assert doc["files"][0] == {"src": "proj/trainer/", "dest": "/opt/census/trainer/"}, doc["files"]
    assert doc["pools"]["chief"]["command"][1:] == ["-m", "trainer.task"]
    in_notes(text, "--labels: team=$(whoami)", "Google Cloud resource labels", "Not applied, and why:")


@pytest.mark.parametrize("script,message", AIP_SCRIPT_ERRORS, ids=[str(i) for i in range(len(AIP_SCRIPT_ERRORS))])
def test_bad_ai_platform_script_one_line(script: str, message: str, tmp_path: Path) -> None:
    aip_project(tmp_path, script)
    (tmp_path / "bare.yaml").write_text("scaleTier: BASIC\npythonModule: m\n")
    code, out, err = run("import", "ai-platform", "train.sh", "-o", "out.yaml", cwd=tmp_path)
    assert code == 1, err
    assert err.startswith(f"Error: {message}"), err
    assert len(err.splitlines()) == 1 and out == "" and not (tmp_path / "out.yaml").exists()


def test_import_vertex_points_an_ai_platform_script_to_ai_platform(tmp_path: Path) -> None:
    aip_project(tmp_path, AIP_SCRIPTS[0][1])
    code, _, err = run("import", "vertex", "train.sh", cwd=tmp_path)
    assert code == 1
    assert err == (
        "Error: train.sh:4: `gcloud ai-platform jobs submit training` submits an AI Platform Training job: "
        "use `provision import ai-platform`\n"
    )


def test_ai_platform_script_packages(tmp_path: Path) -> None:
    """--packages: a gs:// one copied and installed as packageUris are; a local one, which
    gcloud uploaded, pushed with files: and installed; --staging-bucket named."""
    aip_project(
        tmp_path,
        "gcloud ai-platform jobs submit training pk --module-name trainer.task --runtime-version 1.15 \\\n"
        "  --packages dist/extra-0.1.tar.gz,gs://b/dep-1.0.tar.gz --staging-bucket gs://b --config hptuning_config.yaml\n",
    )
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "extra-0.1.tar.gz").write_bytes(b"x")
    doc, text, _ = imported(tmp_path, "ai-platform", "train.sh")
    assert doc["files"] == [{"src": "dist/extra-0.1.tar.gz", "dest": "/opt/pk/packages/extra-0.1.tar.gz"}]
    assert "env" not in doc["pools"]["chief"]
    assert doc["job_spec"]["packageUris"] == ["gs://b/dep-1.0.tar.gz"]
    setup = [line.strip("# -") for line in text.splitlines() if line.startswith("#     - ")]
    assert setup[-2:] == [
        "/opt/venvs/pk/bin/pip install /opt/venvs/pk/packages/dep-1.0.tar.gz",
        "/opt/venvs/pk/bin/pip install /opt/pk/packages/extra-0.1.tar.gz",
    ]
    in_notes(text, "--staging-bucket: gs://b", "where gcloud uploaded the packages", "Not applied, and why:")
    in_notes(text, "--packages: extra-0.1.tar.gz", "pushes them to /opt/pk/packages/", "Applied in part:")


def test_a_huge_categorical_parameter_is_named_by_count_in_one_short_line(tmp_path: Path) -> None:
    """a condition naming a value the parent lacks, on a parent of 10,000
    categories, printed all of them: a 69 KB line. Now the count and a few."""
    values = [f"category-{i:05d}" for i in range(10_000)]
    params = [
        {
            "parameterId": "opt",
            "categoricalValueSpec": {"values": values},
            "conditionalParameterSpecs": [
                {
                    "parameterSpec": {"parameterId": "m", "doubleValueSpec": {"minValue": 0, "maxValue": 1}},
                    "parentCategoricalValues": {"values": ["rmsprop"]},
                }
            ],
        }
    ]
    (tmp_path / "t.json").write_text(vparams(params))
    code, out, err = run("import", "vertex", "t.json", "-o", "out.yaml", cwd=tmp_path)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert len(err) < 400, len(err)
    assert "'rmsprop' is not one of 'opt''s values (category-00000, category-00001," in err
    assert "... (10000 values))" in err and "category-09999" not in err


def test_show_values_caps_each_value_and_the_list() -> None:
    from provision.inventory.yamldoc import show_values

    assert show_values(["a", "b"]) == "a, b"
    assert show_values(list(range(6))) == "0, 1, 2, 3, 4, ... (6 values)"
    assert show_values(["x" * 1000]) == "x" * 57 + "..."
