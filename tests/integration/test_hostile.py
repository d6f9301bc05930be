"""Hostile conditions on a real sandbox host (issue 18.5, 18.9): a disk that fills up in
the middle of a push, and a destination aimed at provision's own env file while a secret
is set. What validation refuses offline is in tests/test_pushed_files.py and
tests/test_validation.py; here the whole CLI runs against a host."""

from __future__ import annotations

import os
import secrets
import subprocess

import pytest
import yaml

from clirun import cli

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
def sb1(sandbox_factory):
    sb = sandbox_factory(hosts=1)
    yield sb
    sandbox_factory.down(sb)


def test_a_full_disk_names_the_path_and_destroy_removes_the_directories_it_made(sb1, sandbox_inventory, tmp_path):
    """Issue 18.9: a 2 MB file pushed into a 1 MB tmpfs. The apply fails with one line that
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
        # The pre-flight disk check (issue 14) refuses it before anything is written ...
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
    """Issue 18.5: `//` and `/./` destinations that name provision's own env file are
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
    """Issue 18's last finding: /opt/hostile-link is a symbolic link on the host to the job's
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
