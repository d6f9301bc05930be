"""Hostile conditions on a real sandbox host (18.9): a disk that fills up in
the middle of a push, and a destination aimed at provision's own env file while a secret
is set. a host whose tar producer sends `provision fetch` crafted streams. What
validation refuses offline is in tests/test_pushed_files.py and tests/test_validation.py
(and fetch's stream rules in tests/test_fetch.py); here the whole CLI runs against a host."""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import secrets
import shlex
import subprocess
import sys
import tarfile

import pytest
import yaml

from clirun import cli, ok, wait_until
from provision.core.target import HostError
from provision.io.ssh import STDERR_KEPT
from provision.run.context import open_context

pytestmark = pytest.mark.integration

LONG = ["/bin/sh", "-c", "exec sleep 600"]
Args = tuple[str, ...]
REFUSED: list[Args] = [("validate",), ("plan",), ("plan", "--json"), ("apply", "-y")]
READS: list[Args] = [("validate",), ("plan",), ("plan", "--json"), ("status",), ("status", "--json")]
CHANGES: list[Args] = [("plan",), ("plan", "--json"), ("apply", "-y"), ("apply", "-y", "-v")]


def on_host(sb, cmd: str) -> tuple[int, str]:
    """A command on host-1 over the sandbox's SSH connection (as root)."""
    with sb.connection("host-1") as c:
        r = c.run(cmd, hide=True, warn=True)
    return r.exited, r.stdout + r.stderr


@pytest.fixture(scope="module")
def sb1(sandbox3):
    """host-1 of the session's sandbox3 (each test puts back what it spoils there)."""
    return dataclasses.replace(sandbox3, hosts=sandbox3.hosts[:1])


def test_a_full_disk_names_the_path_and_destroy_removes_the_directories_it_made(sb1, sandbox_inventory, tmp_path):
    """a 2 MB file pushed into a 1 MB tmpfs. The apply fails with one line that
    names the host path and the system's words, no traceback; the directories the write
    made are recorded, so destroy removes them (and leaves the mount point alone)."""
    code, out = on_host(sb1, "mkdir -p /mnt/tiny && mount -t tmpfs -o size=1m tmpfs /mnt/tiny")
    assert code == 0, f"cannot mount a tmpfs in the sandbox host: {out}"
    try:
        (tmp_path / "big.bin").write_bytes(os.urandom(2 << 20))
        inv = tmp_path / "inv.yaml"
        dest = "/mnt/tiny/sub/dir/file"
        sandbox_inventory(
            sb1,
            job="enospc",
            pools={"chief": {"replicas": 1, "command": LONG}},
            path=inv,
            files=[{"src": "big.bin", "dest": dest}],
        )
        # The pre-flight disk check refuses it before anything is written ...
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "1 MiB free on /mnt/tiny (for /mnt/tiny/sub/dir): files: need 2 MiB" in r.stderr, r.stderr
        assert on_host(sb1, "test -e /mnt/tiny/sub")[0] != 0, "nothing was written"
        # ... and past it, the write itself fails with the system's words.
        r = cli("apply", "-y", "--skip-checks", inv, cwd=tmp_path)
        output = r.stdout + r.stderr
        assert r.returncode not in (0, 3), output
        assert "Traceback" not in output
        lines = [ln for ln in output.splitlines() if "No space left on device" in ln]
        assert len(lines) == 1, output
        assert f"{dest}: No space left on device" in lines[0], output
        code, out = on_host(sb1, "ls -a /mnt/tiny/sub/dir; cat /etc/provision/enospc/created-dirs.json")
        assert code == 0, out
        assert ".provision-tmp" not in out, "the half-written temp file is removed"
        assert '"/mnt/tiny/sub"' in out and '"/mnt/tiny/sub/dir"' in out, out

        r = cli("destroy", "-y", inv, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        code, out = on_host(sb1, "test -e /mnt/tiny/sub; echo sub=$?; mountpoint -q /mnt/tiny; echo mnt=$?")
        assert "sub=1" in out and "mnt=0" in out, out
        assert on_host(sb1, "test -e /etc/provision/enospc")[0] != 0
    finally:
        on_host(sb1, "umount /mnt/tiny; rmdir /mnt/tiny")


def test_a_path_aimed_at_provisions_env_file_is_refused_and_the_secret_never_shown(sb1, sandbox_inventory, tmp_path):
    """`//` and `/./` destinations that name provision's own env file are
    refused by validate (and so by plan and apply), while a secret is set; the secret's value
    (an old and a new one) appears in no output of validate, plan, apply or status, whether
    the job is refused, applied, planned with its secret changed or re-applied, and whether
    as text or JSON. It does reach the host's env file: the check is not vacuous."""
    job = "hostile-env"
    inv = tmp_path / "inv.yaml"
    pools = {"chief": {"replicas": 1, "command": LONG}}
    (tmp_path / "evil.env").write_text("WANDB_API_KEY=stolen\n")
    old, new = "old-" + secrets.token_hex(12), "new-" + secrets.token_hex(12)
    outputs: list[str] = []

    def run(*args, secret: str = old) -> subprocess.CompletedProcess:
        r = cli(*args, inv, cwd=tmp_path, env={"WANDB_API_KEY": secret})
        outputs.append(f"$ provision {' '.join(map(str, args))}\n{r.stdout}{r.stderr}")
        return r

    def write(files: list[dict] | None) -> None:
        extra = {"files": files} if files else {}
        data = sandbox_inventory(sb1, job=job, pools=pools, secret_env=["WANDB_API_KEY"], **extra)
        inv.write_text(yaml.safe_dump(data))

    env_file = f"/etc/provision/{job}/chief-0.env"
    try:
        # Applied once with the secret, so the env file that the bad paths aim at holds it.
        write(None)
        assert run("apply", "-y").returncode == 0, outputs[-1]
        assert on_host(sb1, f"grep -c {old} {env_file}")[1].strip() == "1"

        for dest in (f"//etc/provision/{job}/chief-0.env", f"/etc/./provision/{job}/chief-0.env"):
            write([{"src": "evil.env", "dest": dest}])
            for args in REFUSED:
                r = run(*args)
                assert r.returncode == 1, outputs[-1]
                assert f"{env_file} is reserved for provision's own files" in r.stderr, outputs[-1]
                assert "Traceback" not in r.stderr
        assert on_host(sb1, f"grep -c {old} {env_file}")[1].strip() == "1", "the env file is untouched"

        write(None)
        for args in READS:
            assert run(*args).returncode == 0, outputs[-1]
        # The secret changes: plan and apply show the env file changing, never the values.
        for args in CHANGES:
            run(*args, secret=new)
        assert on_host(sb1, f"grep -c {new} {env_file}")[1].strip() == "1", "\n".join(outputs)
        for args in READS:
            run(*args, secret=new)
    finally:
        run("destroy", "-y")
    everything = "\n".join(outputs)
    for value in (old, new):
        assert value not in everything, everything


def test_a_destination_through_a_link_into_provisions_files_is_refused(sb1, sandbox_inventory, tmp_path):
    """a finding: /opt/hostile-link is a symbolic link on the host to the job's
    own directory, so `dest: /opt/hostile-link/chief-0.env` with `replace: true` passes
    validation (the path as written is not reserved) but would replace provision's env file.
    The host's agent resolves the link and refuses the whole write: one clear line, exit 1,
    the env file untouched, nothing of the push written."""
    job = "hostile-link"
    inv = tmp_path / "inv.yaml"
    pools = {"chief": {"replicas": 1, "command": LONG}}
    (tmp_path / "evil.env").write_text("EVIL=1\n")
    (tmp_path / "ok.txt").write_text("fine\n")

    def write(files: list[dict] | None) -> None:
        extra = {"files": files} if files else {}
        inv.write_text(yaml.safe_dump(sandbox_inventory(sb1, job=job, pools=pools, **extra)))

    env_file = f"/etc/provision/{job}/chief-0.env"
    try:
        write(None)
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        before = on_host(sb1, f"sha256sum {env_file}")[1]
        assert on_host(sb1, f"ln -sfn /etc/provision/{job} /opt/hostile-link")[0] == 0
        write(
            [
                {"src": "ok.txt", "dest": "/opt/hostile-ok/ok.txt"},
                {"src": "evil.env", "dest": "/opt/hostile-link/chief-0.env", "replace": True},
            ]
        )
        assert cli("validate", inv, cwd=tmp_path).returncode == 0  # only the host can tell
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 1, r.stdout + r.stderr
        assert (
            "/opt/hostile-link/chief-0.env: its directory leads into /etc/provision through a symbolic link" in r.stderr
        ), r.stderr
        assert "Traceback" not in r.stderr
        assert on_host(sb1, f"sha256sum {env_file}")[1] == before, "the env file is untouched"
        assert on_host(sb1, "test -e /opt/hostile-ok/ok.txt")[0] != 0, "nothing of the push is written"
    finally:
        on_host(sb1, "rm -f /opt/hostile-link; rm -rf /opt/hostile-ok")
        write(None)
        cli("destroy", "-y", inv, cwd=tmp_path)


def test_the_disk_check_counts_a_nested_destinations_files_once(sb1, sandbox_inventory, tmp_path):
    """files under a destination nested in another were counted for both, so an
    apply that fits was refused; small sizes were shown as "0 MiB"."""
    code, out = on_host(sb1, "mkdir -p /mnt/nest && mount -t tmpfs -o size=3m tmpfs /mnt/nest")
    assert code == 0, f"cannot mount a tmpfs in the sandbox host: {out}"
    try:
        (tmp_path / "tree" / "data").mkdir(parents=True)
        (tmp_path / "tree" / "data" / "x.bin").write_bytes(os.urandom(1700 << 10))
        (tmp_path / "y.bin").write_bytes(b"y" * 300)
        inv = tmp_path / "inv.yaml"
        sandbox_inventory(
            sb1,
            job="nested",
            pools={"chief": {"replicas": 1, "command": LONG}},
            path=inv,
            files=[
                {"src": "tree/", "dest": "/mnt/nest/job/"},
                {"src": "y.bin", "dest": "/mnt/nest/job/data/y.bin"},
            ],
        )
        r = cli("check", inv, cwd=tmp_path)
        out = r.stdout + r.stderr
        assert "): files: need" not in out, out  # 1.7 MB of 3 MB fits (counted twice it was 3.4 MB: refused)
        disk = [ln for ln in out.splitlines() if "free on /mnt/nest" in ln]
        assert disk and all(" 0 MiB" not in ln for ln in disk), out
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        ok(cli("destroy", "-y", inv, cwd=tmp_path))
    finally:
        on_host(sb1, "umount /mnt/nest")


def test_a_host_that_answers_without_end_is_cut_off(sb1, sandbox_inventory, tmp_path):
    """What a host sends back is bounded: an answer past its caller's limit is refused in
    one line, and a command's stderr is kept to 1 MiB however much the host writes."""
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(sb1, job="endless", pools={"chief": {"replicas": 1, "command": LONG}}, path=inv)
    ctx = open_context(str(inv))
    try:
        target = ctx.targets["host-1"]
        with pytest.raises(HostError) as e:
            ctx.session.run(target, "head -c 3000000 /dev/zero; sleep 30", limit=1 << 20)
        assert "sent more than 1048576 bytes in answer to one command" in e.value.message
        r = ctx.session.run(target, "head -c 5000000 /dev/zero >&2; echo done")
        assert r.stdout == b"done\n" and len(r.stderr) == STDERR_KEPT
    finally:
        ctx.close()


# -- fetch: what a host sends back is untrusted (7 and the one-line errors)

FETCHED = "/data/hostile-fetch"
PRODUCER = "/usr/local/bin/tar"  # before /usr/bin on root's and sudo's PATH: fetch runs this
CRAFTED = "/opt/hostile-fetch.tar"


def _tar(*entries: tuple[str, bytes, bytes, str]) -> bytes:
    """(name, kind, data, link) entries as a GNU tar, crafted in memory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, kind, data, link in entries:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mtime = kind, link, 1700000000
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            if kind == tarfile.CHRTYPE:
                info.devmajor, info.devminor = 1, 5
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return buf.getvalue()


def _file(name: str, data: bytes) -> tuple[str, bytes, bytes, str]:
    return name, tarfile.REGTYPE, data, ""


def _chain() -> list[tuple[str, bytes, bytes, str]]:
    """CVE-2025-4517's shape: directories and links whose resolved path outgrows PATH_MAX,
    a link through them out of the destination, a file written through it."""
    entries, path, step = [], "", "d" * 200
    for i in range(16):
        entries += [(path + step, tarfile.DIRTYPE, b"", ""), (path + "l" * (i + 1), tarfile.SYMTYPE, b"", step)]
        path += "l" * (i + 1) + "/"
    return [*entries, ("escape", tarfile.SYMTYPE, b"", path + "../" * 20), _file("escape/owned", b"pwned")]


GOOD = _file("model/a.pt", b"weights")
CRAFTED_STREAMS = {
    "dotdot": (_tar(GOOD, _file("../../../evil", b"xx")), "", "../../../evil: `..` in its path"),
    "device": (_tar(GOOD, ("model/b.pt", tarfile.CHRTYPE, b"", "")), "", "model/b.pt: a character device"),
    "absolute-link": (
        _tar(GOOD, ("model/b.pt", tarfile.SYMTYPE, b"", "/etc")),
        "",
        "model/b.pt: a symbolic link to /etc",
    ),
    "hard-link": (
        _tar(GOOD, ("model/b.pt", tarfile.LNKTYPE, b"", "/etc/shadow")),
        "",
        "model/b.pt: a hard link to /etc/shadow",
    ),
    "link-chain": (_tar(GOOD, *_chain()), "", "a long name of 202 bytes, longer than any the listing announced"),
    "oversize": (  # a header for 10 MB, then the 10 MB: refused at the header
        _tar(_file("model/a.pt", b"w" * 10_000_000))[:512],
        "exec head -c 10000000 /dev/zero",
        "model/a.pt: 10000000 bytes where the listing announced 7",
    ),
    "endless": (_tar(GOOD, _file("model/b.pt", b"bb")), "exec cat /dev/zero", "the host sent more than the "),
    "truncated": (
        _tar(GOOD, _file("model/b.pt", b"bb"))[:515],
        "",
        "model/a.pt: the stream ended 4 bytes before the end of this file",
    ),
}


@pytest.fixture
def fetch_inv(sb1, sandbox_inventory, tmp_path):
    """A job whose outputs: directory on host-1 holds model/a.pt (7 bytes) and model/b.pt
    (2): its listing. Nothing needs applying: fetch lists and tars the directory."""
    inv = tmp_path / "inv.yaml"
    pools = {"chief": {"replicas": 1, "command": LONG}}
    sandbox_inventory(sb1, job="hostile-fetch", pools=pools, path=inv, outputs=FETCHED)
    code, out = on_host(
        sb1, f"mkdir -p {FETCHED}/model && printf weights > {FETCHED}/model/a.pt && printf bb > {FETCHED}/model/b.pt"
    )
    assert code == 0, out
    yield inv
    on_host(sb1, f"rm -f {PRODUCER} {CRAFTED}; rm -rf {FETCHED}")


def _plant(sb, crafted: bytes, then: str = "") -> None:
    """A tar producer on the host that ignores what fetch asks for and sends `crafted`."""
    script = f"#!/bin/sh\ncat >/dev/null\ncat {CRAFTED}\n{then}\n"
    code, out = on_host(
        sb,
        f"echo {base64.b64encode(crafted).decode()} | base64 -d > {CRAFTED} && "
        f"printf %s {shlex.quote(script)} > {PRODUCER} && chmod 755 {PRODUCER}",
    )
    assert code == 0, out


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, r.stderr
    assert not [ln for ln in r.stderr.splitlines() if not ln.startswith(("Error:", "  ..."))], r.stderr
    return errors[0]


def _everything(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("case", list(CRAFTED_STREAMS))
def test_a_crafted_tar_from_the_host_writes_nothing_and_is_one_line(sb1, fetch_inv, tmp_path, case):
    """38.6: the host's tar producer sends a crafted stream. fetch refuses it in
    one line naming the host and the member, exit 1; nothing lands outside -o, and nothing
    of that fetch inside it either (model/a.pt came first and was good: not placed)."""
    crafted, then, problem = CRAFTED_STREAMS[case]
    _plant(sb1, crafted, then)
    out = tmp_path / "deep" / "er" / "out"
    before = _everything(tmp_path)
    r = cli("fetch", fetch_inv, "-o", out, cwd=tmp_path, timeout=120)
    line = _one_error_line(r)
    assert line.startswith(f"Error: chief-0@host-1:{FETCHED}: "), line
    assert problem in line and line.endswith("nothing fetched"), line
    after = _everything(tmp_path)
    assert after - before <= {"deep", "deep/er", "deep/er/out", ".provision"} | {
        p for p in after if p.startswith(".provision/")
    }, sorted(after - before)
    assert not list(out.iterdir()), "nothing of the fetch is left in -o"


def test_something_local_in_the_way_is_one_line(sb1, fetch_inv, tmp_path):
    """-o/model is a file where the host has a directory: one line, exit 1, before the
    transfer (the host's real tar)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model").write_text("mine")
    line = _one_error_line(cli("fetch", fetch_inv, "-o", out, cwd=tmp_path))
    assert f"{out}/model is a file, where chief-0@host-1:{FETCHED} has a directory" in line, line
    assert (out / "model").read_text() == "mine"
    (out / "model").unlink()
    ok(cli("fetch", fetch_inv, "-o", out, cwd=tmp_path))
    assert (out / "model" / "a.pt").read_text() == "weights"


def test_what_a_killed_fetch_left_the_next_one_removes(sb1, fetch_inv, tmp_path):
    """a fetch killed (SIGKILL) mid-transfer leaves its work directory in -o;
    the next fetch removes it (and an earlier version's partial .provision-fetch-*.tar)."""
    code, msg = on_host(sb1, f"head -c 8000000 /dev/urandom > {FETCHED}/model/big.bin")
    assert code == 0, msg
    # The real tar, but only its first 2 MB now: the rest never comes.
    script = (
        '#!/bin/sh\n/usr/bin/tar "$@" > /tmp/hostile-full.tar\nhead -c 2000000 /tmp/hostile-full.tar\nexec sleep 120\n'
    )
    assert on_host(sb1, f"printf %s {shlex.quote(script)} > {PRODUCER} && chmod 755 {PRODUCER}")[0] == 0
    out = tmp_path / "out"
    out.mkdir()
    (out / ".provision-fetch-old.tar").write_bytes(b"x" * 1000)  # what 0.x left
    p = subprocess.Popen(
        [sys.executable, "-m", "provision", "fetch", str(fetch_inv), "-o", str(out)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(
            lambda: any(f.stat().st_size > 1_000_000 for f in out.glob(".provision-fetch-*/model/*")),
            what="the fetch has written part of big.bin",
            timeout=60,
        )
    finally:
        p.kill()
        p.wait()
    assert list(out.glob(".provision-fetch-*/model/big.bin")), "the killed fetch left its work"
    assert not (out / "model").exists(), "nothing of it was placed"
    on_host(sb1, f"rm -f {PRODUCER}")
    r = ok(cli("fetch", fetch_inv, "-o", out, cwd=tmp_path))
    assert "3 of 3 files changed" in r.stderr, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model"]
    assert (out / "model" / "big.bin").stat().st_size == 8000000
