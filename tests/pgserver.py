"""A real PostgreSQL server for tests: Debian's `postgresql` package (scripts/setup.sh installs
it), started on loopback with its own data directory and port, stopped at the end.

    def test_team_state(postgres):          # the fixture in tests/conftest.py
        url = postgres.url()                      # postgresql://provision@127.0.0.1:PORT/provision
        postgres.stop(); postgres.start()         # the database going away and coming back
        env = postgres.env()                      # PGPASSWORD for a client process

The server runs as the `postgres` system user (PostgreSQL refuses root). Nothing of this is
needed by provision itself: only team state and shared studies use a database.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

USER = "provision"
PASSWORD = "provision-test-password"
DATABASE = "provision"


def bindir() -> Path | None:
    """The newest installed server's bin directory (Debian keeps them per major version)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    return Path(found[-1]).parent if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, root: Path):
        bd = bindir()
        if bd is None:
            raise RuntimeError("PostgreSQL is not installed (scripts/setup.sh installs Debian's postgresql)")
        self.bin = bd
        self.root = root
        self.data = root / "data"
        self.sockets = root / "sockets"
        self.port = free_port()
        self._as_root = os.geteuid() == 0

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = list(argv)
        if self._as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=120)

    def init(self) -> Server:
        self.root.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(exist_ok=True)
        pwfile = self.root / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if self._as_root:
            pg = pwd.getpwnam("postgres")
            for p in (self.root, self.sockets, pwfile):
                os.chown(p, pg.pw_uid, pg.pw_gid)
        self._run(
            str(self.bin / "initdb"),
            "-D",
            str(self.data),
            "-U",
            USER,
            "--pwfile",
            str(pwfile),
            "-A",
            "scram-sha-256",
            "--no-sync",
        )
        pwfile.unlink()
        return self

    def start(self) -> None:
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.sockets} -c fsync=off"
        self._run(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"), "-w", "start"
        )
        end = time.monotonic() + 30
        while time.monotonic() < end:
            r = subprocess.run(
                [str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)], capture_output=True
            )
            if r.returncode == 0:
                break
            time.sleep(0.2)
        if not self._has_db():
            self._psql("postgres", f"CREATE DATABASE {DATABASE}")

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def _psql(self, db: str, sql: str) -> str:
        r = subprocess.run(
            [str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, "-d", db, "-tAc", sql],
            capture_output=True,
            text=True,
            env={**os.environ, "PGPASSWORD": PASSWORD},
            timeout=60,
        )
        if r.returncode != 0:
            raise RuntimeError(f"psql: {r.stderr.strip()}")
        return r.stdout

    def _has_db(self) -> bool:
        return self._psql("postgres", f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE}'").strip() == "1"

    def sql(self, statement: str) -> str:
        """Run SQL on the test database as the test user; its output, tab-separated."""
        return self._psql(DATABASE, statement)

    def url(self, *, password: bool = False, database: str = DATABASE) -> str:
        auth = f"{USER}:{PASSWORD}" if password else USER
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"

    def env(self) -> dict[str, str]:
        """What a client process needs to log in (credentials never in the URL in clear)."""
        return {"PGPASSWORD": PASSWORD}

    def cleanup(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def start_server() -> Server:
    root = Path(tempfile.mkdtemp(prefix="provision-pg-"))
    os.chmod(root, 0o755)
    server = Server(root).init()
    server.start()
    return server
