"""Team state, the parts without a database: the `state:` setting and
PROVISION_STATE, the State over any Store (compare-and-set, a failed save), the local
history, migrate between two stores, ownership by a shared backend, and the lazy import
(one person with a local state never loads database code)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from provision.core.errors import ProvisionError
from provision.core.records import HostRecord
from provision.inventory.statebackend import ENV, Backend, backend_of, chosen, problem
from provision.io import state as S
from provision.io.stateops import migrate, show_json, show_lines
from provision.io.statestore import Change, LockInfo, Store
from provision.rules.tenancy import Hold, Holder, Owner, owner_problem

URL = "postgresql://provision@db.internal:5432/jobs"


# --------------------------------------------------------------------------- the setting


@pytest.mark.parametrize(
    "value",
    [
        "local",
        URL,
        "postgres://db.internal/jobs",
        "postgresql:///jobs?host=/run/postgresql",
        "postgresql://ana@[fd00::5]:5433/jobs?sslmode=require",
    ],
)
def test_good_state_settings(value):
    assert problem(value) is None


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("", "expected local or a postgresql:// URL"),
        (3, "expected local or a postgresql:// URL"),
        ("Local", "got 'Local'"),
        ("mysql://u:pw@h/db", "got a mysql:// URL"),
        ("postgresql://u:hunter2@h/db", "a password in the URL is not accepted"),
        ("postgresql://u@h/db?password=hunter2", "a password in the URL is not accepted"),
        ("postgresql://u@h:port/db", "host and port cannot be read"),
        ("postgresql:/u@h/db", "expected local or a postgresql:// URL"),
        ("user:hunter2@h", "got something else"),
    ],
)
def test_bad_state_settings_never_echo_a_password(value, says):
    why = problem(value)
    assert why is not None and says in why, why
    assert "hunter2" not in why


def test_the_environment_wins_and_is_checked():
    assert chosen("local", "inv.yaml", {}) == Backend("local", "default")
    assert chosen(URL, "inv.yaml", {}) == Backend(URL, "inv.yaml: state")
    assert chosen(URL, "inv.yaml", {ENV: "local"}) == Backend("local", ENV)
    assert chosen("local", "inv.yaml", {ENV: URL}) == Backend(URL, ENV)
    assert chosen(URL, "inv.yaml", {ENV: "  "}).url == URL  # empty: not set
    with pytest.raises(ProvisionError, match=f"^{ENV}: a password in the URL is not accepted") as e:
        chosen("local", "inv.yaml", {ENV: "postgresql://u:hunter2@h/db"})
    assert "hunter2" not in e.value.message


def test_the_place_names_the_database_whoever_logs_in():
    a = Backend("postgresql://ana@db.internal/jobs?sslmode=require")
    b = Backend("postgres://bo@db.internal:5432/jobs")
    assert a.place == b.place == "postgresql://db.internal:5432/jobs"
    assert Backend("postgresql://ana@[fd00::5]:5433/jobs").place == "postgresql://[fd00::5]:5433/jobs"
    assert Backend().place == "local" and Backend().local and Backend(URL).kind == "postgresql"


def test_a_state_file_beside_a_database_is_refused(tmp_path, monkeypatch):
    from provision.inventory.inventory import parse

    monkeypatch.delenv(ENV, raising=False)
    inv = parse(
        f"job: j\nstate: {URL}\nhosts: [{{name: h1, address: 192.0.2.1}}]\n"
        "pools: {chief: {replicas: 1, command: [/bin/true]}}\n",
        tmp_path / "inv.yaml",
    )
    assert inv.state == URL
    assert backend_of(inv, "inv.yaml").url == URL
    with pytest.raises(ProvisionError, match=r"--state x.json names a local state file, but job j's state is in"):
        backend_of(inv, "inv.yaml", "x.json")
    monkeypatch.setenv(ENV, "local")
    assert backend_of(inv, "inv.yaml", "x.json").local


# --------------------------------------------------------------------------- State over a Store


class MemoryStore(Store):
    """A backend in memory, compare-and-set on the serial as PostgreSQL's is."""

    def __init__(self, job: str = "j", where: str = "memory://x"):
        self.backend, self.job, self.local_path = Backend(URL, "test"), job, Path(f"/nonexistent/{job}.state.json")
        self.where, self.noun, self.unreadable_hint = where, f"state of job {job}", "fix it"
        self.doc: bytes | None = None
        self.serial: int | None = None
        self.secret = b"k" * 32
        self.changes: list[Change] = []
        self.moved: str | None = None
        self.fail = False

    @property
    def owner_ref(self) -> str:
        return self.backend.place

    def read(self):
        if self.moved:
            raise ProvisionError(f"{self.where}: moved to {self.moved}")
        return self.doc

    def write(self, data, *, serial, lineage, expect, backup):
        if self.fail:
            raise ProvisionError(f"{self.where}: cannot save")
        if expect != self.serial:
            raise ProvisionError(f"{self.where}: changed by another run")
        self.doc, self.serial = data, serial

    def key(self):
        return self.secret

    def lock(self, operation):
        return S.StateLock(Path("/tmp") / f"memory-{id(self)}.json", operation)

    def held(self):
        return None

    def force_unlock(self, lock_id):
        raise ProvisionError("no lock")

    def record(self, change):
        self.changes.append(change)

    def history(self, n):
        return list(reversed(self.changes))[:n]

    def peek(self):
        return self.doc, self.moved

    def adopt(self, data, *, lineage, serial, key, history):
        self.doc, self.serial, self.secret, self.moved = data, serial, key, None
        self.changes += [c for c in reversed(history) if c not in self.changes]

    def retire(self, to):
        self.moved = to


def test_saves_are_compare_and_set_on_the_serial_read():
    store = MemoryStore()
    a = S.State.load(store, "j")
    assert not a.exists
    a.record_host("h1", HostRecord("192.0.2.1"))
    b = S.State.load(store, "j")  # another teammate reads serial 1
    assert b.exists and b.lineage == a.lineage and b.serial == 1
    a.record_host("h2", HostRecord("192.0.2.2"))  # serial 2
    with pytest.raises(ProvisionError, match="changed by another run"):
        b.record_host("h3", HostRecord("192.0.2.3"))
    assert json.loads(store.doc)["serial"] == 2 and "h3" not in json.loads(store.doc)["hosts"]


def test_a_failed_save_is_tried_again_from_what_is_stored():
    store = MemoryStore()
    st = S.State.load(store, "j")
    st.record_host("h1", HostRecord("192.0.2.1"))
    store.fail = True
    with pytest.raises(ProvisionError, match="cannot save"):
        st.record_host("h2", HostRecord("192.0.2.2"))
    assert st.serial == 1  # not counted as saved
    store.fail = False
    st.record_host("h3", HostRecord("192.0.2.3"))
    data = json.loads(store.doc)
    assert data["serial"] == 2 and set(data["hosts"]) == {"h1", "h2", "h3"}


def test_the_key_is_the_backends_and_the_history_records_who(tmp_path):
    store = MemoryStore()
    st = S.State.load(store, "j")
    assert st.keyed("0" * 64) == S.State.load(store, "j").keyed("0" * 64)
    st.record_host("h1", HostRecord("192.0.2.1"))
    st.note("ana@lab.example", "apply", "Apply complete! Resources: 1 added, 0 changed, 0 destroyed.")
    assert store.history(5) == [Change(store.changes[0].at, "ana@lab.example", "apply", 1, store.changes[0].summary)]
    doc = show_json(store, S.State.load(store, "j"))
    assert doc["exists"] and doc["serial"] == 1 and doc["last_change"]["who"] == "ana@lab.example"
    assert doc["hosts"]["h1"]["address"] == "192.0.2.1"
    assert any("ana@lab.example" in line for line in show_lines(doc))


def test_the_local_history_and_a_retired_local_state(tmp_path):
    sp = tmp_path / "j.state.json"
    local = S.LocalStore(sp)
    assert local.history(3) == []
    for i in range(5):
        local.record(Change(f"2026-01-01T10:00:0{i}+00:00", "ana", "apply", i, f"change {i}"))
    assert [c.summary for c in local.history(3)] == ["change 4", "change 3", "change 2"]
    assert oct((tmp_path / "j.state.json.history").stat().st_mode & 0o777) == "0o600"
    st = S.State.load(sp, "j")
    st.record_host("h1", HostRecord("192.0.2.1"))
    local.retire(URL)
    with pytest.raises(ProvisionError, match=r"moved to another backend by `provision state migrate`"):
        S.State.load(sp, "j")


def test_migrate_keeps_lineage_serial_key_and_history(tmp_path):
    sp = tmp_path / "j.state.json"
    st = S.State.load(sp, "j")
    st.record_host("h1", HostRecord("192.0.2.1"))
    st.record_host("h2", HostRecord("192.0.2.2"))
    st.note("ana", "apply", "Apply complete!")
    keyed = st.keyed("0" * 64)
    target = MemoryStore()
    lineage, serial = migrate(S.LocalStore(sp), target, "bo")
    assert (lineage, serial) == (st.lineage, 2)
    assert target.doc == (tmp_path / "j.state.json.migrated").read_bytes()  # byte for byte
    assert not sp.exists()
    moved = S.State.load(target, "j")
    assert (moved.lineage, moved.serial, moved.keyed("0" * 64)) == (st.lineage, 2, keyed)
    assert [c.operation for c in target.history(5)] == ["migrate", "apply"]
    # ... and back: the local file again, the other side retired.
    assert migrate(target, S.LocalStore(sp), "bo") == (st.lineage, 2)
    back = S.State.load(sp, "j")
    assert (back.lineage, back.serial, back.keyed("0" * 64)) == (st.lineage, 2, keyed)
    with pytest.raises(ProvisionError, match="moved to"):
        S.State.load(target, "j")


def test_migrate_refuses_a_target_with_another_lineage(tmp_path):
    sp = tmp_path / "j.state.json"
    S.State.load(sp, "j").record_host("h1", HostRecord("192.0.2.1"))
    target = MemoryStore()
    S.State.load(target, "j").record_host("h9", HostRecord("192.0.2.9"))  # another job j
    before = target.doc
    with pytest.raises(ProvisionError, match="already holds a state of job j with another lineage"):
        migrate(S.LocalStore(sp), target, "bo")
    assert target.doc == before and sp.exists()  # nothing changed on either side
    with pytest.raises(ProvisionError, match="no state of job k here: nothing to migrate"):
        migrate(S.LocalStore(tmp_path / "k.state.json"), MemoryStore("k"), "bo")


# --------------------------------------------------------------------------- ownership


def _holder(owner: Owner) -> Holder:
    return Holder("h1", "j", owner, (), (), None, Hold.RUNNING, "t")


def test_teammates_on_one_backend_are_one_owner():
    place = Backend(URL).place
    ana = Owner("lineage-1", "ana@lab.example", "ws-1", 10, place)
    bo = Owner.here("lineage-1", place)  # the same lineage: read from the same row
    assert bo.state == place
    assert owner_problem("j", _holder(ana), bo, take_over=False) is None
    # The row recreated (a new lineage) at the same database: still the team's state.
    assert owner_problem("j", _holder(ana), Owner.here("lineage-2", place), take_over=False) is None
    # Another database, or a local file: refused as before, naming the owner's state.
    other = Owner.here("lineage-3", "postgresql://db2.internal:5432/jobs")
    why = owner_problem("j", _holder(ana), other, take_over=False)
    assert why is not None and place in why and "--take-over" in why
    local = Owner.here("lineage-4", Path("/tmp/x/j.state.json"))
    assert owner_problem("j", _holder(ana), local, take_over=False) is not None
    assert local.state == str(Path("/tmp/x/j.state.json").resolve())


# --------------------------------------------------------------------------- the rest


def test_the_lock_line_says_the_database_frees_it():
    from provision.io.statestore import locked_error

    holder = LockInfo("id-1", "ana", 42, "ws-1", "apply", "then")
    assert "the database frees the lock" in locked_error(holder, server_frees=True)
    assert locked_error(holder, server_frees=False).startswith("state is locked: apply by ana on ws-1 (pid 42)")


def test_database_errors_are_one_phrase():
    pytest.importorskip("psycopg")
    from provision.io.pgstate import lock_key, why

    e = Exception(
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  password '
        'authentication failed for user "provision"\n'
    )
    assert why(e) == (
        'connection to server at "127.0.0.1", port 5432 failed: password authentication failed for user '
        '"provision" (libpq takes the password from PGPASSWORD or ~/.pgpass)'
    )
    multi = Exception(
        "Multiple connection attempts failed. All failures were:\n"
        "- host: 'localhost', port: '1', hostaddr: '::1': connection failed: connection to server at \"::1\", "
        "port 1 failed: Connection refused\n"
        "- host: 'localhost', port: '1', hostaddr: '127.0.0.1': connection failed: connection to server at "
        '"127.0.0.1", port 1 failed: Connection refused'
    )
    assert why(multi) == 'connection to server at "127.0.0.1", port 1 failed: Connection refused'
    assert lock_key("mnist") == lock_key("mnist") != lock_key("mnist2")
    assert -(2**63) <= lock_key("mnist") < 2**63


def test_a_local_state_never_loads_database_code(tmp_path):
    """One person with a local state never sees a database: psycopg is not even imported."""
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "job: j\nhosts: [{name: h1, address: 192.0.2.1}]\npools: {chief: {replicas: 1, command: [/bin/true]}}\n"
    )
    code = (
        "import sys\n"
        "from provision.run.context import open_context\n"
        "from provision.cli import statecmd, offline\n"
        f"ctx = open_context({str(inv)!r}, operation='apply', render_secrets=False)\n"
        "ctx.close()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('psycopg', 'provision.io.pgstate'))))\n"
    )
    env_free = {k: v for k, v in __import__("os").environ.items() if k != ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_free, check=True)
    assert out.stdout.strip() == "[]"
