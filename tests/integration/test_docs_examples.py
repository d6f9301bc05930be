"""The documentation's examples, run: every command line of README.md and docs/*.md in a
block marked `<!-- run: sandbox -->` (the rules: tests/test_docs.py's docstring), run as a
reader would run it, on sandbox hosts, expecting exit 0.

The world the lines run in is made from the docs themselves:

- one working directory for every page, holding `inventories/` and `examples/` (links to
  the repository's) and every file a page shows in a block whose first line is `# NAME`
  (the README's `inventory.yaml` and `bert.sh`, import.md's `submit.sh` and `hosts.yaml`),
  plus the two files lines name that no page shows: `train.py` (the README's program:
  `print('hello')`) and `config.yaml` (import.md's AI Platform config: the census job of
  tests/fixtures/import/, behind inventories/imported/census-hptuning.yaml);
- `inventory.yaml` is the README's first inventory on a sandbox of two hosts with one GPU
  each (the sandbox's nvidia-smi stand-in): its `ssh:` and each host's address, port and
  cluster address are the sandbox's; names, accelerators (their type too: the one the
  stand-in reports, as tests/test_docs.py checks), pools and `files:` are the README's;
- a sandbox's `--name NAME` (`sandbox up`, `sandbox down`) becomes a name of this test's
  own, removed at the end whatever happens;
- a run block's `export NAME=VALUE` lines set NAME for its later lines;
- `apply`, `destroy` and `stop` without `-y` get a terminal on stdin and answer `yes`.

Lines run in phases by command, in document order within a phase, so that a page may show
`status` or `exec` without the `apply` before it: `sandbox up`, `sandbox list`, `import`,
`init`; `validate`, `render`; `facts`, `check`, `plan`; `apply`; `status`, `logs`, `wait`,
`exec`, `ssh`, `jobs`; `stop`; `destroy`; `sandbox down`. A line shown on several pages
runs once; `A && B` runs B only when A exits 0, as a shell does.

Output is not compared, except what the README quotes of plan and status: a run line's
trailing comment that starts `Plan:` or `Job ` is printed by that line, and once the job
has succeeded, `plan` prints the sentence the README quotes ("No changes: the job
succeeded, ...").
"""

from __future__ import annotations

import itertools
import os
import pty
import re
import shlex
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import doclines
from clirun import cli

pytestmark = pytest.mark.integration

REPO = doclines.REPO
NOT_SHOWN = {
    "train.py": "print('hello')\n",
    "config.yaml": (REPO / "tests" / "fixtures" / "import" / "census_hptuning.yaml").read_text(),
}
WORLD = "inventory.yaml"
PHASES: dict[tuple[str, ...], int] = {
    ("sandbox", "up"): 0,
    ("sandbox", "list"): 0,
    ("import",): 0,
    ("init",): 0,
    ("validate",): 1,
    ("render",): 1,
    ("facts",): 2,
    ("check",): 2,
    ("plan",): 2,
    ("apply",): 3,
    ("status",): 4,
    ("logs",): 4,
    ("wait",): 4,
    ("exec",): 4,
    ("ssh",): 4,
    ("jobs",): 4,
    ("stop",): 5,
    ("destroy",): 6,
    ("sandbox", "down"): 7,
}
AFTER_THE_JOB = 4  # the phase after which the README's finished-job sentence is checked
ASKS = {"apply", "destroy", "stop"}
QUOTE = re.compile(r"\s#\s*((?:Plan:|Job ).*?)\s*$")  # a trailing comment quoting plan or status
TIMEOUT = 300


def phase(argv: list[str]) -> int:
    for key in (tuple(argv[1:3]), tuple(argv[1:2])):
        if key in PHASES:
            return PHASES[key]
    raise AssertionError(f"{shlex.join(argv)}: no phase for this command: add it to PHASES")


@dataclass
class Run:
    line: doclines.DocLine
    argvs: list[list[str]]
    env: dict[str, str]
    phase: int


def doc_runs() -> list[Run]:
    """Every run line of the docs, once, in the order the test runs them."""
    commands = doclines.top_commands()
    runs, seen = [], set()
    for path in doclines.doc_files():
        for block in doclines.blocks(path):
            if not block.runs:
                continue
            exports = doclines.exports(block)
            for line in doclines.command_lines(block, commands):
                env = {name: value for n, name, value in exports if n < line.line}
                argvs = doclines.chains(line.text)
                key = (tuple(map(tuple, argvs)), tuple(sorted(env.items())))
                if key not in seen:
                    seen.add(key)
                    runs.append(Run(line, argvs, env, phase(argvs[0])))
    return sorted(runs, key=lambda r: r.phase)  # stable: document order within a phase


def shown_files() -> dict[str, str]:
    """NAME -> text of every file the docs show (tests/test_docs.py checks that two blocks
    showing one NAME agree)."""
    out: dict[str, str] = {}
    for path in doclines.doc_files():
        for block in doclines.blocks(path):
            if block.shows_file:
                out.setdefault(block.shows_file, block.text)
    return out


def on_sandbox(text: str, base: dict, sandbox_name: str) -> str:
    """The README's inventory with the sandbox's ssh settings and addresses."""
    inv = yaml.safe_load(text)
    assert len(base["hosts"]) >= len(inv["hosts"]), "the sandbox has fewer hosts than the README's inventory"
    inv["ssh"] = base["ssh"]
    for host, real in zip(inv["hosts"], base["hosts"]):
        # Only where the hosts are: the accelerators stay as the README declares them (a
        # type sandbox hosts do not report fails apply's pre-flight, as it would for a reader).
        host.update(address=real["address"], port=real["port"], cluster_address=real["cluster_address"])
    head = f"# README.md's first inventory on sandbox {sandbox_name!r} (tests/integration/test_docs_examples.py)\n"
    return head + yaml.safe_dump(inv, sort_keys=False)


def run_argv(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`provision ARGS` as the docs write it; a command that would ask gets a terminal on
    stdin, where `yes` is already typed."""
    args = argv[1:]
    if args[0] not in ASKS or {"-y", "--auto-approve"} & set(args):
        return cli(*args, cwd=cwd, env=env, timeout=TIMEOUT)
    master, slave = pty.openpty()
    try:
        os.write(master, b"yes\n")
        return subprocess.run(
            [sys.executable, "-m", "provision", *args],
            cwd=cwd,
            stdin=slave,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env={**os.environ, **env},
        )
    finally:
        os.close(slave)
        os.close(master)


def rename_sandboxes(argv: list[str], names: dict[str, str], factory) -> list[str]:
    """`--name NAME` of `sandbox up`/`down`: a name of the test's own for each NAME."""
    if argv[1] != "sandbox" or "--name" not in argv:
        return argv
    i = argv.index("--name") + 1
    if argv[i] not in names:
        names[argv[i]] = factory.unique_name()
        factory.started.append(names[argv[i]])  # removed at the session's end, should this test die
    return [*argv[:i], names[argv[i]], *argv[i + 1 :]]


def report(run: Run, argv: list[str], p: subprocess.CompletedProcess, why: str) -> str:
    out = textwrap.indent((p.stdout + p.stderr).strip()[-3000:], "    ")
    return f"{run.line.where}: {run.line.text}\n  ran: provision {shlex.join(argv[1:])}\n  {why}\n{out}"


@pytest.fixture(scope="module")
def world(sandbox_factory, sandbox_inventory, tmp_path_factory):
    sb = sandbox_factory(hosts=2, gpus_per_host=1)
    work = tmp_path_factory.mktemp("docs")
    for name in ("inventories", "examples"):
        (work / name).symlink_to(REPO / name)
    files = {**NOT_SHOWN, **shown_files()}
    for name, text in files.items():
        (work / name).write_text(text)
    (work / WORLD).write_text(on_sandbox(files[WORLD], sandbox_inventory(sb), sb.name))
    yield work
    sandbox_factory.down(sb)


@pytest.mark.timeout(900)
def test_doc_command_lines_exit_0_on_sandbox_hosts(world, sandbox_factory):
    runs = doc_runs()
    assert len(runs) >= 20, "fewer run lines than expected: is the marker still `<!-- run: sandbox -->`?"
    names: dict[str, str] = {}
    failures: list[str] = []
    began = time.monotonic()
    try:
        for ph, group in itertools.groupby(runs, key=lambda r: r.phase):
            for run in group:
                for argv in run.argvs:
                    argv = rename_sandboxes(argv, names, sandbox_factory)
                    p = run_argv(argv, world, run.env)
                    if p.returncode != 0:
                        failures.append(report(run, argv, p, f"exit {p.returncode}, expected 0"))
                        break
                    quoted = QUOTE.search(run.line.text)
                    if quoted and quoted.group(1) not in p.stdout:
                        failures.append(
                            report(run, argv, p, f"does not print what the docs quote: {quoted.group(1)!r}")
                        )
            if ph == AFTER_THE_JOB:
                failures += finished_job_sentence(world)
    finally:
        for name in names.values():
            sandbox_factory.down(name)
    print(f"{len(runs)} doc lines ran in {time.monotonic() - began:.0f} s")
    assert not failures, f"{len(failures)} doc lines failed:\n\n" + "\n\n".join(failures)


def finished_job_sentence(work: Path) -> list[str]:
    """The README says what a no-op apply prints once the job has finished: plan says it."""
    text = " ".join(doclines.README.read_text(encoding="utf-8").split())
    m = re.search(r'"(No changes: the job succeeded, [^"]*)"', text)
    assert m, "README.md no longer quotes the finished job's 'No changes: ...': update this test"
    p = cli("plan", WORLD, cwd=work, timeout=TIMEOUT)
    if p.returncode == 0 and m.group(1) in " ".join(p.stdout.split()):
        return []
    return [
        f"README.md quotes {m.group(1)!r}; `provision plan {WORLD}` after the job exit {p.returncode}:\n{p.stdout}{p.stderr}"
    ]
