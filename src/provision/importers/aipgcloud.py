"""A `gcloud [beta|alpha] ai-platform jobs submit training JOB ... [-- USER_ARGS]` command (or
the older `gcloud ml-engine jobs submit training`), as AI Platform Training's tuning examples
give it: the flags say what runs, its --config (a Job: `trainingInput: hyperparameters:`)
the study.

gcloud.py finds the command in the script; here its flags become the Job gcloud would send
(flags over the --config file, gcloud's rule), and `aiplatform.from_data` reads that as it
reads a config.yaml. What gcloud did on the way -- package `--package-path`, upload local
`--packages` -- becomes `files:` that push them, `PYTHONPATH`, and the setup block.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import aiplatform
from .common import JSON, JobPlan, Note, PoolPlan, SpecError, Where, integer, job_name, mapping, merge_setup, venv
from .gcloud import Found, Word, _config, _flag_note, _local_dir, arg_list, command_text, expand, expand_value, flag_of

BOOLEAN_FLAGS = frozenset({"--async", "--stream-logs", "--enable-web-access", "--quiet", "-q", "--help", "--log-http"})
# Flags that are a TrainingInput field, as gcloud fills it in.
STRING_FIELDS = {
    "--module-name": "pythonModule",
    "--job-dir": "jobDir",
    "--runtime-version": "runtimeVersion",
    "--python-version": "pythonVersion",
    "--region": "region",
    "--service-account": "serviceAccount",
    "--network": "network",
    "--master-machine-type": "masterType",
    "--worker-machine-type": "workerType",
    "--parameter-server-machine-type": "parameterServerType",
}
COUNT_FIELDS = {"--worker-count": "workerCount", "--parameter-server-count": "parameterServerCount"}
CONFIGS = {"master": "masterConfig", "worker": "workerConfig", "parameter-server": "parameterServerConfig"}
POOL_FLAG = re.compile(r"--(master|worker|parameter-server)-(accelerator|image-uri)")
FLAG_WHY = {
    "--staging-bucket": "where gcloud uploaded the packages: files: pushes them to the hosts",
    "--stream-logs": "`provision logs -f INVENTORY` follows the tasks' logs",
    "--async": "`provision apply` returns once the tasks started; add --wait to wait",
    "--labels": "Google Cloud resource labels",
    "--tpu-tf-version": "the TPU software is the hosts' own",
}


@dataclass(frozen=True)
class AipCommand:
    """The command as the Job gcloud would have sent, and what gcloud did besides."""

    line: int
    group: str  # "ai-platform" | "ml-engine"
    data: dict[str, JSON] = field(hash=False, compare=False)  # a Job: jobId, trainingInput, ...
    source: str = ""  # the --config file (errors in the job name it), or SCRIPT:LINE
    flags: dict[str, str] = field(default_factory=dict, hash=False, compare=False)  # trainingInput key → its flag
    package: Path | None = None  # --package-path, resolved
    tarballs: tuple[Path, ...] = ()  # local --packages
    job_word: str | None = None  # JOB as written, when only the shell could work all of it out
    notes: tuple[Note, ...] = ()


def _words(found: Found, display: str) -> tuple[list[tuple[str, str | None, Word]], list[Word], Word | None]:
    """gcloud's flags (name, value or None, word; a stray word has the name ""), the user
    arguments after `--`, and JOB (the first word that is no flag nor a flag's value)."""
    words = list(found.words)
    user: list[Word] = []
    for i, w in enumerate(words):
        if w.literal() == "--":
            words, user = words[:i], words[i + 1 :]
            break
    flags: list[tuple[str, str | None, Word]] = []
    job: Word | None = None
    i = 0
    while i < len(words):
        w = words[i]
        named = flag_of(w)
        if named is None:
            if job is None:
                job = w
            else:
                flags.append(("", _shown(w), w))
            i += 1
            continue
        flag, eq, given = _flag_word(w, found, display, named)
        has_value = bool(eq)
        if not eq and flag not in BOOLEAN_FLAGS and i + 1 < len(words):
            if not (words[i + 1].literal() or "").startswith("--"):
                given, has_value = _value(words[i + 1], found, display, flag), True
                i += 1
        flags.append((flag, given if has_value else None, w))
        i += 1
    return flags, user, job


class _Unread(str):
    """A flag's value only the shell can work out: its text as the script writes it (a note
    shows it so); `why` says so in one line, raised where the value is used (_given)."""

    why: str

    def __new__(cls, text: str, why: str) -> _Unread:
        s = super().__new__(cls, text)
        s.why = why
        return s


def _value(w: Word, found: Found, display: str, flag: str) -> str:
    """The word after a flag, expanded; what only the shell can work out kept as written."""
    try:
        return expand_value(w, found.variables, display, flag)
    except SpecError as e:
        return _Unread(_shown(w), e.message)


def _flag_word(w: Word, found: Found, display: str, name: str) -> tuple[str, str, str]:
    """A `--flag[=value]` word (`name`: flag_of's): its name, "=" or "", its value (_value's)."""
    try:
        return expand_value(w, found.variables, display, name).partition("=")
    except SpecError as e:
        if "=" not in w.parts[0][1]:  # the flag's own name needs the shell (`--$X=1`)
            raise
        return name, "=", _Unread(_shown(w).split("=", 1)[1], e.message)


def _shown(w: Word) -> str:
    """A word as the script spells it."""
    return "".join(t if k in ("lit", "shell") else f"${{{t}}}" for k, t in w.parts)


def _read_config(value: str | None, base_dir: Path) -> tuple[str, dict[str, JSON]]:
    """--config: a Job (`trainingInput: ...`), as gcloud reads it."""
    source, data = _config(value, base_dir, "a Job (trainingInput: ..., as gcloud's --config takes)")
    if "trainingInput" not in data and aiplatform.INPUT_KEYS & set(data):
        Where(source).fail(
            "gcloud's --config is a Job: put these keys under trainingInput: (as in `trainingInput: {hyperparameters: ...}`)"
        )
    if "trainingInput" not in data and {"workerPoolSpecs", "studySpec", "trialJobSpec"} & set(data):
        Where(source).fail(
            "this is a Vertex AI config (workerPoolSpecs / studySpec): its command is "
            "`gcloud ai custom-jobs create` or `hp-tuning-jobs create`, read by `provision import vertex`"
        )
    return source, data


class _Request:
    """The TrainingInput as the flags fill it in over the config's (gcloud's rule)."""

    def __init__(self, source: str, data: dict[str, JSON], base_dir: Path):
        self.source, self.base_dir = source, base_dir
        self.ti = dict(mapping(data.get("trainingInput"), Where(source) / "trainingInput"))
        self.from_flag: dict[str, str] = {}
        self.package: Path | None = None
        self.tarballs: list[Path] = []
        self.uris: list[str] = []
        self.notes: list[Note] = []

    def set(self, key: str, value: JSON, flag: str) -> None:
        self.ti[key] = value
        self.from_flag[key] = flag

    def pool_config(self, role: str) -> dict[str, JSON]:
        key = CONFIGS[role]
        cfg = dict(mapping(self.ti.get(key), Where(self.source) / "trainingInput" / key))
        self.ti[key] = cfg
        return cfg

    def flag(self, name: str, value: str | None, at: Where) -> None:  # noqa: C901  one branch per kind of gcloud flag
        if name in STRING_FIELDS:
            self.set(STRING_FIELDS[name], _given(value, at), name)
        elif name in COUNT_FIELDS:
            self.set(COUNT_FIELDS[name], integer(_given(value, at), at), name)
        elif name == "--scale-tier":
            tier = _given(value, at).upper().replace("-", "_")
            if tier not in aiplatform.SCALE_TIERS:
                tiers = ", ".join(t.lower().replace("_", "-") for t in aiplatform.SCALE_TIERS)
                at.fail(f"expected one of {tiers}, got {value!r}")
            self.set("scaleTier", tier, name)
        elif (m := POOL_FLAG.fullmatch(name)) is not None:
            cfg = self.pool_config(m.group(1))
            if m.group(2) == "image-uri":
                cfg["imageUri"] = _given(value, at)
            else:
                cfg["acceleratorConfig"] = _accelerator(_given(value, at), at)
        elif name == "--use-chief-in-tf-config":
            word = ("true" if value is None else _given(value, at)).lower()
            if word not in ("true", "false"):
                at.fail(f"expected true or false, got {value!r}")
            self.ti["useChiefInTfConfig"] = word == "true"
        elif name == "--enable-web-access":
            self.set("enableWebAccess", True, name)
        elif name == "--package-path":
            self.package = _local_dir(_given(value, at), self.base_dir, at)
        elif name == "--packages":
            for p in arg_list(_given(value, at)):
                if p.startswith("gs://"):
                    self.uris.append(p)
                else:
                    self.tarballs.append(_local_file(p, self.base_dir, at))
        else:
            why = FLAG_WHY.get(name) or _flag_note(name, value).why
            self.notes.append(Note(name, value if value is not None else "(set)", why))


def parse(found: Found, display: str, base_dir: Path, default_name: str) -> AipCommand:
    """The flags over --config (a Job with trainingInput), as gcloud builds the request."""
    where = Where(f"{display}:{found.line}")
    flags, user, job_w = _words(found, display)
    source: str = where.source
    data: dict[str, JSON] = {}
    for name, value, _ in flags:
        if name == "--config":
            source, data = _read_config(_given(value, where) if isinstance(value, _Unread) else value, base_dir)
    r = _Request(source, data, base_dir)
    for name, value, w in flags:
        if name == "":
            r.notes.append(Note(f"line {w.line}", str(value), "a second JOB? gcloud takes one: not applied"))
        elif name != "--config":
            r.flag(name, value, Where(f"{display}:{w.line}", name))
    if r.uris:
        r.set("packageUris", r.uris, "--packages")
    if user:  # over the config's args, gcloud's rule
        r.set("args", [expand(w, found.variables, display) for w in user], "-- (the user arguments)")

    ti = r.ti
    image = mapping(ti.get("masterConfig"), Where(source)).get("imageUri")
    if not ti.get("pythonModule") and not image:
        also = (
            f", and {source} neither trainingInput.pythonModule nor masterConfig.imageUri"
            if source != where.source
            else ""
        )
        raise SpecError(
            f"{where.source}: the command has neither --module-name (with --package-path) nor --master-image-uri{also}: what does this job run?"
        )
    if ti.get("pythonModule") and not image and r.package is None and not r.tarballs and not ti.get("packageUris"):
        raise SpecError(
            f"{where.source}: --module-name without --package-path or --packages: where is the module's code?"
        )

    job_id, job_word = _job(job_w, found, display, default_name)
    data = {**data, "jobId": job_id, "trainingInput": ti}
    return AipCommand(
        found.line, found.kind, data, source, r.from_flag, r.package, tuple(r.tarballs), job_word, tuple(r.notes)
    )


def _given(value: str | None, at: Where) -> str:
    if value is None:
        at.fail("expected a value")
    if isinstance(value, _Unread):
        raise SpecError(value.why)
    return value


def _accelerator(value: str, at: Where) -> dict[str, JSON]:
    """`type=nvidia-tesla-v100,count=2` → an AcceleratorConfig (count 1 when not given, as gcloud)."""
    keys: dict[str, str] = {}
    for item in arg_list(value):
        key, eq, v = item.partition("=")
        if not eq or key not in ("type", "count"):
            at.fail(f"expected type=TYPE[,count=COUNT], got {value!r}")
        keys[key] = v
    if "type" not in keys:
        at.fail(f"missing type= (such as type=nvidia-tesla-v100), got {value!r}")
    return {
        "count": integer(keys.get("count", "1"), at / "count", lo=1),
        "type": keys["type"].upper().replace("-", "_"),
    }


def _local_file(value: str, base_dir: Path, at: Where) -> Path:
    for base in (base_dir, Path.cwd()):
        p = (base / os.path.expanduser(value)).resolve()
        if p.is_file():
            return p
    at.fail(f"no such file: {value} (looked beside the script and in the current directory)")


def _job(w: Word | None, found: Found, display: str, default_name: str) -> tuple[str, str | None]:
    """JOB's text; when only the shell could work it out (`census_$(date ...)`, a common
    way to make it unique), its literal part, and the word as written for the note."""
    if w is None:
        raise SpecError(f"{display}:{found.line}: the command has no JOB (gcloud's first argument: the job's name)")
    try:
        return expand(w, found.variables, display), None
    except SpecError:
        literal = "".join(t for k, t in w.parts if k == "lit")
        return (literal if job_name(literal) != "imported" else default_name), _shown(w)


def _with_package(
    cmd: AipCommand,
    plan: JobPlan,
    root: str,
    runs_module: bool,
    files: list[tuple[str, str]],
    installs: list[str],
    partly: list[Note],
    notes: list[Note],
) -> tuple[PoolPlan, ...]:
    """--package-path: pushed with files: (and a setup.py beside it installed), PYTHONPATH
    on every pool that runs the module; the lists given are added to."""
    pools = plan.pools
    if cmd.package is not None and runs_module:
        dest = f"{root}/{cmd.package.name}"
        files.append((str(cmd.package), dest))
        setup_py = cmd.package.parent / "setup.py"
        said = ""
        if setup_py.is_file():  # gcloud builds with it when it is there: its install_requires too
            files.append((str(setup_py), f"{root}/setup.py"))
            installs.append(root)
            said = (
                f"; the setup.py beside it pushed to {root}/ and installed by the setup block, as gcloud built with it"
            )
        partly.append(
            Note(
                "--package-path",
                cmd.package.name + "/",
                f"gcloud packaged it for AI Platform; here files: pushes it to {dest}/, PYTHONPATH {root}{said}",
            )
        )
        pools = tuple(
            replace(
                p,
                env=(("PYTHONPATH", root), *p.env),
                comments=(
                    *p.comments,
                    f"files: pushes {cmd.package.name}/ (--package-path) to {dest}; PYTHONPATH {root}",
                ),
            )
            if not p.image
            else p
            for p in pools
        )
    elif cmd.package is not None:
        notes.append(
            Note("--package-path", cmd.package.name + "/", "the job runs containers (--master-image-uri): not used")
        )
    return pools


def to_plan(cmd: AipCommand, display: str, *, job: str | None, trial: str | None, default_name: str) -> JobPlan:
    """The Job through aiplatform.from_data, then what gcloud did besides: the package
    pushed, PYTHONPATH, its installs in the setup block; notes named by the flags."""
    plan = aiplatform.from_data(cmd.data, cmd.source, job=job, trial=trial, default_name=default_name)
    by_flag = {f"trainingInput.{key}": flag for key, flag in cmd.flags.items()}

    def renamed(n: Note) -> Note:
        if n.path == "jobId":
            if cmd.job_word is not None:
                return Note("JOB", cmd.job_word, f"only the shell can work out the whole name: job {plan.job}")
            return replace(n, path="JOB")
        for path, flag in by_flag.items():
            if n.path == path or n.path.startswith(path + ".") or n.path.startswith(path + "["):
                return replace(n, path=flag + n.path[len(path) :])
        return n

    partly = [renamed(n) for n in plan.partly]
    if cmd.job_word is not None and not any(n.path == "JOB" for n in partly):
        partly.append(Note("JOB", cmd.job_word, f"only the shell can work out the whole name: job {plan.job}"))
    notes = [renamed(n) for n in plan.not_applied] + list(cmd.notes)
    files: list[tuple[str, str]] = list(plan.files)
    installs: list[str] = []
    root = f"/opt/{plan.job}"
    runs_module = any(not p.image for p in plan.pools)
    pools = _with_package(cmd, plan, root, runs_module, files, installs, partly, notes)
    for t in cmd.tarballs if runs_module else ():
        files.append((str(t), f"{root}/packages/{t.name}"))
        installs.append(f"{root}/packages/{t.name}")
    if cmd.tarballs:
        partly.append(
            Note(
                "--packages",
                ", ".join(t.name for t in cmd.tarballs),
                f"gcloud uploaded them; here files: pushes them to {root}/packages/ and the setup block installs them"
                if runs_module
                else "the job runs containers (--master-image-uri): not used",
            )
        )
    setup = plan.setup
    if installs:
        v = venv(plan.job)
        head = () if setup else (f"python3 -m venv {v}",)
        setup = merge_setup(setup, head, (f"{v}/bin/pip install " + " ".join(installs),))
    return replace(
        plan,
        origin=f"a `{command_text(cmd.group)}` command ({display}, line {cmd.line})",
        pools=pools,
        files=tuple(files),
        setup=setup,
        not_applied=tuple(notes),
        partly=tuple(partly),
    )
