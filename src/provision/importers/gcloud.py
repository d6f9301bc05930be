"""A `gcloud [beta|alpha] ai custom-jobs create` (or `hp-tuning-jobs create`) command line,
as found in a shell script.

The script is split into words the way a POSIX shell does it (quotes, backslash escapes
and line continuations, comments, `;`/`&&`/`|` between commands), and `$NAME`/`${NAME}`
are taken from assignments earlier in the file (`NAME=value`, `export NAME=value`), then
from the environment. What the shell would have to run to know (`$(...)`, backquotes,
`$1`) is refused where the command needs it, with its line and flag. `$PWD`, `${PWD}` and
`$(pwd)` are the script's directory (where such a script is run from), unless it sets PWD.

The flags become a CustomJobSpec, as gcloud would send it, for `vertex.from_spec`; those of
`hp-tuning-jobs create` go over its --config, a HyperparameterTuningJob, for
`vertex.from_tuning_job`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .common import JSON, Note, SpecError, Where, integer, read_yaml_file
from .vertex import LocalPackage

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PWD = re.compile(r"pwd(\s+-[LP])?")  # `$(pwd)`, `$(pwd -P)`: the directory, as $PWD is
KINDS = ("custom-jobs", "hp-tuning-jobs")  # `gcloud ai KIND create`


@dataclass(frozen=True)
class Word:
    parts: tuple[tuple[str, str], ...]  # ("lit", text) | ("var", NAME) | ("shell", what the shell would run)
    line: int

    def literal(self) -> str | None:
        """The word's text when it needs no expansion."""
        return "".join(t for _, t in self.parts) if all(k == "lit" for k, _ in self.parts) else None


Command = tuple[Word, ...]


class _Splitter:
    """POSIX shell word splitting, enough for scripts that call gcloud."""

    def __init__(self, text: str, display: str):
        self.s = text.replace("\r\n", "\n")
        self.display = display
        self.i = 0
        self.line = 1
        self.commands: list[Command] = []
        self.words: list[Word] = []
        self.parts: list[tuple[str, str]] = []
        self.buf: list[str] = []
        self.in_word = False
        self.word_line = 1

    def fail(self, what: str) -> SpecError:
        return SpecError(f"{self.display}:{self.line}: {what}")

    def _flush(self) -> None:
        if self.buf:
            self.parts.append(("lit", "".join(self.buf)))
            self.buf = []

    def _end_word(self) -> None:
        self._flush()
        if self.in_word:
            self.words.append(Word(tuple(self.parts), self.word_line))
        self.parts, self.in_word = [], False

    def _end_command(self) -> None:
        self._end_word()
        if self.words:
            self.commands.append(tuple(self.words))
        self.words = []

    def _start(self) -> None:
        if not self.in_word:
            self.in_word, self.word_line = True, self.line

    def run(self) -> list[Command]:  # noqa: C901  a shell tokenizer: one branch per kind of character
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c == "\\" and s.startswith("\n", self.i + 1):  # line continuation
                self.i += 2
                self.line += 1
            elif c in " \t":
                self._end_word()
                self.i += 1
            elif c == "\n":
                self._end_command()
                self.line += 1
                self.i += 1
            elif c == "#" and not self.in_word:
                end = s.find("\n", self.i)
                self.i = len(s) if end < 0 else end
            elif c in ";&|()<>":
                self._end_command()  # redirections and pipes: the command's words end here
                self.i += 1
            else:
                self._start()
                if c == "\\":
                    self.buf.append(s[self.i + 1 : self.i + 2])
                    self.i += 2
                elif c == "'":
                    end = s.find("'", self.i + 1)
                    if end < 0:
                        raise self.fail("a single quote that is never closed")
                    self.buf.append(s[self.i + 1 : end])
                    self.line += s.count("\n", self.i, end)
                    self.i = end + 1
                elif c == '"':
                    self._double()
                elif c == "$":
                    self._dollar()
                elif c == "`":
                    self._backquote()
                else:
                    self.buf.append(c)
                    self.i += 1
        self._end_command()
        return self.commands

    def _double(self) -> None:
        s = self.s
        self.i += 1
        while True:
            if self.i >= len(s):
                raise self.fail("a double quote that is never closed")
            c = s[self.i]
            if c == '"':
                self.i += 1
                return
            if c == "\\" and s[self.i + 1 : self.i + 2] in ('"', "\\", "$", "`", "\n"):
                if s[self.i + 1] == "\n":
                    self.line += 1
                else:
                    self.buf.append(s[self.i + 1])
                self.i += 2
            elif c == "$":
                self._dollar()
            elif c == "`":
                self._backquote()
            else:
                self.line += c == "\n"
                self.buf.append(c)
                self.i += 1

    def _dollar(self) -> None:
        s, i = self.s, self.i
        if s.startswith("${", i):
            end = s.find("}", i)
            if end < 0:
                raise self.fail("a ${ that is never closed")
            inner = s[i + 2 : end]
            self._flush()
            self.parts.append(("var", inner) if NAME.fullmatch(inner) else ("shell", s[i : end + 1]))
            self.i = end + 1
        elif s.startswith("$(", i):
            depth, j = 0, i + 1
            while j < len(s):
                depth += {"(": 1, ")": -1}.get(s[j], 0)
                if depth == 0:
                    break
                j += 1
            if j >= len(s):
                raise self.fail("a $( that is never closed")
            self._flush()
            pwd = PWD.fullmatch(s[i + 2 : j].strip())
            self.parts.append(("var", "PWD") if pwd else ("shell", s[i : j + 1]))
            self.line += s.count("\n", i, j)
            self.i = j + 1
        elif (m := NAME.match(s, i + 1)) is not None:
            self._flush()
            self.parts.append(("var", m.group()))
            self.i = m.end()
        elif i + 1 < len(s) and (s[i + 1].isdigit() or s[i + 1] in "@*#?$!-"):
            self._flush()
            self.parts.append(("shell", s[i : i + 2]))
            self.i += 2
        else:
            self.buf.append("$")
            self.i += 1

    def _backquote(self) -> None:
        end = self.s.find("`", self.i + 1)
        if end < 0:
            raise self.fail("a backquote that is never closed")
        self._flush()
        pwd = PWD.fullmatch(self.s[self.i + 1 : end].strip())
        self.parts.append(("var", "PWD") if pwd else ("shell", self.s[self.i : end + 1]))
        self.line += self.s.count("\n", self.i, end)
        self.i = end + 1


def split(text: str, display: str) -> list[Command]:
    return _Splitter(text, display).run()


def expand(word: Word, variables: dict[str, str | None], display: str) -> str:
    out: list[str] = []
    for kind, text in word.parts:
        if kind == "lit":
            out.append(text)
        elif kind == "var" and variables.get(text) is not None:
            out.append(str(variables[text]))
        elif kind == "var" and text not in variables and text in os.environ:
            out.append(os.environ[text])
        elif kind == "var":
            why = (
                "is set from something only the shell can work out"
                if text in variables
                else "is not set in this file or in the environment"
            )
            raise SpecError(f"{display}:{word.line}: ${text} {why}: set it above the command, or write the value")
        else:
            raise SpecError(
                f"{display}:{word.line}: {_short(text)}: only the shell can work this out: write the value (or set a variable above the command)"
            )
    return "".join(out)


def expand_value(word: Word, variables: dict[str, str | None], display: str, flag: str) -> str:
    """A flag's value (the word after it, or the whole `--flag=value` word): expand's, and
    what only the shell can work out one line that names the flag and the value as written."""
    try:
        return expand(word, variables, display)
    except SpecError as e:
        written = "".join(t if k in ("lit", "shell") else f"${{{t}}}" for k, t in word.parts)
        written = written.split("=", 1)[1] if written.startswith(flag + "=") else written
        why = e.message.removeprefix(f"{display}:{word.line}: ")
        raise SpecError(f"{display}:{word.line}: {flag}: cannot read {_short(written)}: {why}") from None


def flag_of(word: Word) -> str | None:
    """The flag a word names when it starts as one (`--package-path=$(pwd)/x`), else None."""
    kind, text = word.parts[0] if word.parts else ("", "")
    return text.split("=", 1)[0] if kind == "lit" and text.startswith("-") else None


def _short(text: str) -> str:
    """Shell text in a one-line message: its first line, cut short."""
    first = text.splitlines()[0] if text else text
    return first if len(first) <= 40 and first == text else first[:37] + "..."


ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")
DECLARE = ("export", "readonly", "declare", "local", "typeset")


def _assignment(word: Word) -> str | None:
    head = word.parts[0] if word.parts else ("", "")
    m = ASSIGN.match(head[1]) if head[0] == "lit" else None
    return m.group(1) if m else None


def _assign(word: Word, name: str, variables: dict[str, str | None], display: str) -> None:
    kind, text = word.parts[0]
    rest = Word(((kind, text[len(name) + 1 :]), *word.parts[1:]), word.line)
    try:
        variables[name] = expand(rest, variables, display)
    except SpecError:
        variables[name] = None  # an error only if the command uses it


@dataclass(frozen=True)
class Found:
    words: tuple[Word, ...]  # gcloud's arguments after the command path
    line: int
    variables: dict[str, str | None] = field(hash=False, compare=False)
    kind: str = "custom-jobs"  # or "hp-tuning-jobs"; "ai-platform" or "ml-engine" (jobs submit training)


def find(text: str, display: str, here: Path | None = None) -> Found | None:
    """The script's `gcloud ... ai custom-jobs|hp-tuning-jobs create` (or `ai-platform|ml-engine
    jobs submit training`) command, with the variables set before it (`here`: the script's
    directory, its PWD)."""
    variables: dict[str, str | None] = {} if here is None else {"PWD": str(here)}
    found: list[Found] = []
    for cmd in split(text, display):
        words = list(cmd)
        if words and words[0].literal() in DECLARE:
            words = words[1:]
        while words and _assignment(words[0]):  # NAME=value ... [command]
            name = _assignment(words[0])
            assert name is not None
            if len(words) == 1 or all(_assignment(w) for w in words) or cmd[0].literal() in DECLARE:
                _assign(words[0], name, variables, display)
            words = words[1:]
        if not words or os.path.basename(words[0].literal() or "") != "gcloud":
            continue
        rest = words[1:]
        positional = [(i, w.literal()) for i, w in enumerate(rest) if not (w.literal() or "-").startswith("-")]
        names = [p for _, p in positional]
        for k in range(len(names)):
            if names[k] == "ai" and k + 2 < len(names) and names[k + 1] in KINDS and names[k + 2] == "create":
                kind, length = str(names[k + 1]), 3
            elif names[k] in AIP_GROUPS and names[k + 1 : k + 4] == ["jobs", "submit", "training"]:
                kind, length = str(names[k]), 4  # AI Platform Training (aipgcloud.py reads it)
            else:
                continue
            # The command path; what comes before it are gcloud's own flags and their
            # values (`--project p`), which stay for the flag parser.
            first = k - 1 if k and names[k - 1] in ("beta", "alpha") else k
            skip = {positional[j][0] for j in range(first, k + length)}
            kept = tuple(w for i, w in enumerate(rest) if i not in skip)
            found.append(Found(kept, words[0].line, dict(variables), kind))
            break
    if len(found) > 1:
        lines = ", ".join(str(f.line) for f in found)
        kinds = {f.kind for f in found}
        what = (
            command_text(found[0].kind)
            if len(kinds) == 1
            else "gcloud ai custom-jobs / hp-tuning-jobs create"
            if kinds <= set(KINDS)
            else "gcloud ... training"
        )
        raise SpecError(
            f"{display}: {len(found)} `{what}` commands (lines {lines}): import one at a time (one per file)"
        )
    return found[0] if found else None


AIP_GROUPS = ("ai-platform", "ml-engine")  # `gcloud GROUP jobs submit training`: AI Platform Training


def command_text(kind: str) -> str:
    """The command path of a Found's kind, as the user wrote it."""
    return f"gcloud {kind} jobs submit training" if kind in AIP_GROUPS else f"gcloud ai {kind} create"


# --------------------------------------------------------------------------- flags → CustomJobSpec

POOL_KEYS = (
    "machine-type",
    "replica-count",
    "accelerator-type",
    "accelerator-count",
    "container-image-uri",
    "executor-image-uri",
    "python-module",
    "script",
    "local-package-path",
    "output-image-uri",
    "requirements",
    "extra-packages",
    "extra-dirs",
    "disk-type",
    "disk-size",
)
BOOLEAN_FLAGS = frozenset(
    {"--enable-web-access", "--enable-dashboard-access", "--async", "--quiet", "-q", "--help", "--log-http"}
)
FLAG_WHY = {
    "--region": "your hosts are where they are",
    "--project": "the Google Cloud project the job ran in",
    "--labels": "Google Cloud resource labels",
    "--service-account": "no Google Cloud identity on your hosts: pass credentials with secret_env",
    "--network": "tasks reach each other at the hosts' cluster_address; no VPC peering",
    "--enable-web-access": "interactive shell of the service: use `provision ssh`",
    "--enable-dashboard-access": "the service's dashboard access",
    "--persistent-resource-id": "a Vertex AI persistent resource: the hosts are yours",
    "--kms-key": "Google Cloud key management (CMEK)",
    "--kms-keyring": "Google Cloud key management (CMEK)",
    "--kms-location": "Google Cloud key management (CMEK)",
    "--kms-project": "Google Cloud key management (CMEK)",
    "--async": "`provision apply` returns once the tasks started; add --wait to wait",
}


@dataclass(frozen=True)
class GcloudJob:
    line: int
    display_name: str | None
    spec: dict[str, JSON] = field(hash=False, compare=False)  # a CustomJobSpec, as gcloud would send it
    spec_source: str = ""  # the --config file (its errors name it), or SCRIPT:LINE
    local: dict[int, LocalPackage] = field(default_factory=dict, hash=False, compare=False)
    notes: tuple[Note, ...] = ()


def arg_list(value: str) -> list[str]:
    """gcloud's list flags: comma-separated, or `^DELIM^a DELIM b` for another delimiter."""
    m = re.match(r"\^([^^]+)\^", value)
    delim, value = (m.group(1), value[m.end() :]) if m else (",", value)
    return value.split(delim) if value else []


def _flags(found: Found, display: str, notes: list[Note]) -> list[tuple[str, str | None, Word]]:
    """The command line's flags as (name, value or None, the word), `--flag value` and
    `--flag=value` alike; a word that is no flag becomes a note."""
    flags: list[tuple[str, str | None, Word]] = []
    words = found.words
    i = 0
    while i < len(words):
        w = words[i]
        text = expand(w, found.variables, display)
        if not text.startswith("-"):
            notes.append(
                Note(f"line {w.line}", text, "an argument gcloud would not take here; not known to provision import")
            )
            i += 1
            continue
        flag, eq, given = text.partition("=")
        if (
            not eq
            and flag not in BOOLEAN_FLAGS
            and i + 1 < len(words)
            and not (words[i + 1].literal() or "").startswith("--")
        ):
            given = expand(words[i + 1], found.variables, display)
            i += 1
        flags.append((flag, given if (eq or given) else None, w))
        i += 1
    return flags


def _every_pool(spec: dict[str, JSON], common_args: list[str] | None, common_command: list[str] | None) -> None:
    """--args and --command apply to every pool, over the config file's (gcloud's rule)."""
    raw = spec.get("workerPoolSpecs")
    for pool in raw if isinstance(raw, list) else [raw] if isinstance(raw, dict) else []:
        if not isinstance(pool, dict) or not pool:
            continue
        for key in ("containerSpec", "pythonPackageSpec"):
            task = pool.get(key)
            if isinstance(task, dict):
                if common_args is not None:
                    task["args"] = list(common_args)
                if common_command is not None and key == "containerSpec":
                    task["command"] = list(common_command)


def parse(found: Found, display: str, base_dir: Path) -> GcloudJob:
    """The command's flags → a CustomJobSpec; --config (beside the script) under the flags."""
    notes: list[Note] = []
    flags = _flags(found, display, notes)
    where = f"{display}:{found.line}"
    display_name: str | None = None
    config: dict[str, JSON] | None = None
    config_source = where
    pools: list[tuple[str, Word]] = []
    common_args: list[str] | None = None
    common_command: list[str] | None = None
    package_uris: list[str] = []
    for name, value, w in flags:
        if name == "--display-name":
            display_name = value or ""
        elif name == "--worker-pool-spec":
            pools.append((value or "", w))
        elif name == "--config":
            config_source, config = _config(value, base_dir, "a CustomJobSpec (workerPoolSpecs: ...)")
        elif name == "--args":
            common_args = arg_list(value or "")
        elif name == "--command":
            common_command = arg_list(value or "")
        elif name == "--python-package-uris":
            package_uris = arg_list(value or "")
        else:
            notes.append(_flag_note(name, value))
    if not pools and config is None:
        raise SpecError(f"{where}: the command has neither --worker-pool-spec nor --config: no worker pools to import")

    spec: dict[str, JSON] = dict(config or {})
    local: dict[int, LocalPackage] = {}
    if pools:
        built = [_pool(k, value, w, display, base_dir, package_uris, local) for k, (value, w) in enumerate(pools)]
        spec["workerPoolSpecs"] = built
        config_source = where
    _every_pool(spec, common_args, common_command)
    return GcloudJob(found.line, display_name, spec, config_source, local, tuple(notes))


def _config(value: str | None, base_dir: Path, what: str) -> tuple[str, dict[str, JSON]]:
    """--config FILE (beside the script): the file as its errors name it, and its mapping."""
    path = base_dir / (value or "")
    source = str(Path(os.path.relpath(path)) if not Path(value or "").is_absolute() else path)
    data = read_yaml_file(path, source)
    if not isinstance(data, dict):
        Where(source).fail(f"expected {what}")
    return source, data


def _flag_note(name: str, value: str | None) -> Note:
    """A flag provision does not apply, with the reason."""
    why = FLAG_WHY.get(name, "gcloud's own option" if name in GCLOUD_WIDE else "not known to provision import")
    return Note(name, value if value is not None else "(set)", why)


# --------------------------------------------------------------------------- hp-tuning-jobs create

TRIAL_COUNTS = {"--max-trial-count": "maxTrialCount", "--parallel-trial-count": "parallelTrialCount"}
ALGORITHM_FLAG = {
    "algorithm-unspecified": "ALGORITHM_UNSPECIFIED",
    "grid-search": "GRID_SEARCH",
    "random-search": "RANDOM_SEARCH",
}


@dataclass(frozen=True)
class TuningCommand:
    """`gcloud ai hp-tuning-jobs create`: the HyperparameterTuningJob gcloud would send."""

    line: int
    data: dict[str, JSON] = field(hash=False, compare=False)
    source: str = ""  # the --config file: errors in the job name it
    named_by_flag: bool = False  # --display-name was given
    notes: tuple[Note, ...] = ()


def parse_tuning(found: Found, display: str, base_dir: Path) -> TuningCommand:
    """--config (a HyperparameterTuningJob: studySpec, trialJobSpec, ...) with the flags over it."""
    notes: list[Note] = []
    where = f"{display}:{found.line}"
    source, data = where, None
    over: dict[str, JSON] = {}
    algorithm = None
    for name, value, w in _flags(found, display, notes):
        at = Where(f"{display}:{w.line}", name)
        if name == "--config":
            source, data = _config(value, base_dir, "a HyperparameterTuningJob (studySpec, trialJobSpec, ...)")
        elif name == "--display-name":
            over["displayName"] = value or ""
        elif name in TRIAL_COUNTS:
            over[TRIAL_COUNTS[name]] = integer(value or "", at, lo=1)
        elif name == "--algorithm":
            algorithm = ALGORITHM_FLAG.get(value or "")
            if algorithm is None:
                at.fail(f"expected one of {', '.join(ALGORITHM_FLAG)}, got {value!r}")
        else:
            notes.append(_flag_note(name, value))
    if data is None:
        raise SpecError(f"{where}: the command has no --config: gcloud reads the study and the trial job from it")
    data = {**data, **over}
    study = data.get("studySpec")
    if algorithm is not None and isinstance(study, dict):
        data["studySpec"] = {**study, "algorithm": algorithm}
    return TuningCommand(found.line, data, source, "displayName" in over, tuple(notes))


GCLOUD_WIDE = frozenset(
    {
        "--project",
        "--account",
        "--billing-project",
        "--configuration",
        "--flags-file",
        "--flatten",
        "--format",
        "--impersonate-service-account",
        "--log-http",
        "--quiet",
        "-q",
        "--trace-token",
        "--verbosity",
        "--help",
        "--user-output-enabled",
    }
)


def _machine(keys: dict[str, str], at: Where) -> dict[str, JSON]:
    """--worker-pool-spec's machine keys as a MachineSpec."""
    machine: dict[str, JSON] = {}
    if "machine-type" in keys:
        machine["machineType"] = keys["machine-type"]
    if "accelerator-type" in keys:
        machine["acceleratorType"] = keys["accelerator-type"]
    if "accelerator-count" in keys:
        machine["acceleratorCount"] = integer(keys["accelerator-count"], at / "accelerator-count")
    return machine


def _pool(  # noqa: C901  one branch per key of a --worker-pool-spec flag
    k: int, value: str, w: Word, display: str, base_dir: Path, package_uris: list[str], local: dict[int, LocalPackage]
) -> dict[str, JSON]:
    """One --worker-pool-spec flag → a WorkerPoolSpec; `local` gets its local package, if any."""
    at = Where(f"{display}:{w.line}", f"--worker-pool-spec[{k}]")
    if not value:
        return {}  # an empty flag keeps the position, like `{}` in workerPoolSpecs
    keys: dict[str, str] = {}
    for item in arg_list(value):
        key, eq, v = item.partition("=")
        if not eq:
            at.fail(f"expected KEY=VALUE items separated by commas, got {item!r}")
        if key not in POOL_KEYS:
            (at / key).fail(f"unknown key (known: {', '.join(POOL_KEYS)})")
        keys[key] = v
    replicas = integer(keys.get("replica-count", "1"), at / "replica-count")
    if k == 0 and replicas != 1:
        (at / "replica-count").fail(
            f"the first worker pool, the primary replica, runs exactly one replica, got {replicas}"
        )
    pool: dict[str, JSON] = {"machineSpec": _machine(keys, at), "replicaCount": str(replicas)}  # int64: a string
    disk = {k2: keys[k1] for k1, k2 in (("disk-type", "bootDiskType"), ("disk-size", "bootDiskSizeGb")) if k1 in keys}
    if disk:
        pool["diskSpec"] = disk

    container, executor = keys.get("container-image-uri"), keys.get("executor-image-uri")
    module, script, package = keys.get("python-module"), keys.get("script"), keys.get("local-package-path")
    if container and executor:
        at.fail("give container-image-uri or executor-image-uri, not both")
    if container:
        pool["containerSpec"] = {"imageUri": container}
        return pool
    if not executor:
        at.fail("give container-image-uri, or executor-image-uri with python-module (what does this pool run?)")
    if bool(module) == bool(script):
        at.fail("executor-image-uri needs python-module or script (one of them)")
    if package is None:
        if script or not package_uris:
            at.fail("python-module with executor-image-uri needs --python-package-uris (or local-package-path)")
        pool["pythonPackageSpec"] = {
            "executorImageUri": executor,
            "packageUris": list(package_uris),
            "pythonModule": module,
        }
        return pool
    path = _local_dir(package, base_dir, at / "local-package-path")
    local[k] = LocalPackage(
        path,
        module,
        script,
        tuple(r for r in keys.get("requirements", "").split(";") if r),
        tuple(e for e in keys.get("extra-packages", "").split(";") if e),
    )
    # gcloud builds an image from the package on the executor image and runs the module
    # there; the spec records it as the python package it is.
    as_module = module or re.sub(r"\.py$", "", str(script)).replace("/", ".")
    pool["pythonPackageSpec"] = {"executorImageUri": executor, "packageUris": [], "pythonModule": as_module}
    return pool


def _local_dir(value: str, base_dir: Path, at: Where) -> Path:
    """The script's directory first, then the current one (where the script may be run from)."""
    for base in (base_dir, Path.cwd()):
        p = (base / os.path.expanduser(value)).resolve()
        if p.is_dir():
            return p
    at.fail(f"no such directory: {value} (looked beside the script and in the current directory)")
