"""The dashboard joined to the service (serve/source.py, cli/servecmd.py): tokens kept hashed
in the service's database (SQLite here; test_servicestore covers the schema on PostgreSQL
too), the TokenCheck they back, which Auth a --listen address gets and the refusals, and
usage from the history."""

from __future__ import annotations

import calendar

import pytest
from starlette.testclient import TestClient

from clirun import run
from provision.core.errors import ProvisionError
from provision.core.submission import Kind
from provision.io.servicehistory import HistoryRow
from provision.io.servicestore import ServiceStore, Submission, token_hash
from provision.rules.usage import HOLDING, Use, gpu_hours
from provision.serve.source import Listen, ServiceSource, choose_auth, parse_listen, usage_json, usage_windows
from provision.web.app import make_app
from provision.web.auth import Mode


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("PROVISION_SERVICE_DB", str(tmp_path / "svc" / "service.sqlite"))
    s = ServiceStore.open_local()
    yield s
    s.close()


def test_tokens_are_kept_hashed_listed_and_revoked(store, tmp_path):
    row, token = store.create_token("ana@example.com", admin=False)
    admin, admin_token = store.create_token("ops", admin=True)
    assert len(token) >= 43 and token != admin_token  # 32 random bytes, url-safe base64
    assert store.owner_of(token) == ("ana@example.com", False)
    assert store.owner_of(admin_token) == ("ops", True)
    assert store.owner_of("nope") is None and store.owner_of("") is None
    # (Both made in the same millisecond of the database's clock: the order by id is random.)
    assert sorted((t.id, t.owner, t.admin) for t in store.tokens()) == sorted(
        [(row.id, row.owner, False), (admin.id, "ops", True)]
    )
    raw = b"".join(p.read_bytes() for p in (tmp_path / "svc").glob("service.sqlite*"))  # the WAL too
    assert token.encode() not in raw and token_hash(token).encode() in raw
    assert store.revoke_token(row.id) and not store.revoke_token(row.id)
    assert store.owner_of(token) is None and store.owner_of(admin_token) == ("ops", True)


def test_token_commands(store, tmp_path):
    code, out, err = run("serve", "token", "create", "--owner", "ana@example.com", "--admin", cwd=tmp_path)
    assert code == 0, err
    token = out.strip()
    assert store.owner_of(token) == ("ana@example.com", True)
    code, out, _ = run("serve", "token", "list", cwd=tmp_path)
    assert code == 0 and "ana@example.com" in out and "yes" in out and token not in out
    tid = store.tokens()[0].id
    assert run("serve", "token", "revoke", tid, cwd=tmp_path)[0] == 0
    code, _, err = run("serve", "token", "revoke", tid, cwd=tmp_path)
    assert code != 0 and f"no token {tid}" in err
    assert "No tokens yet" in run("serve", "token", "list", cwd=tmp_path)[1]


@pytest.mark.parametrize(
    "owner,why",
    [
        (
            "ana\nzed  yes    2020-01-01 00:00",
            "a name has no control characters (newlines, escapes, ...), got 'ana\\x0azed",
        ),
        ("ana\x1b[2J", "a name has no control characters (newlines, escapes, ...), got 'ana\\e[2J'"),
        ("", "expected a name (as teammates know them, e.g. ann@example.com), got an empty one"),
        ("   ", "expected a name (as teammates know them, e.g. ann@example.com), got an empty one"),
        ("a" * 201, "at most 200 characters, got 201"),
    ],
)
def test_a_token_owner_is_one_line_of_a_sane_length(store, tmp_path, owner, why):
    """A newline in --owner forged a row of `token list`, an empty owner was taken: refused,
    in one line naming the flag, and nothing is made."""
    code, out, err = run("serve", "token", "create", "--owner", owner, cwd=tmp_path)
    assert code == 1 and out == "", out
    assert err.startswith(f"Error: --owner: {why}") and len(err.splitlines()) == 1, err
    assert store.tokens() == []


def test_token_list_shows_an_owner_the_database_holds_as_text(store, tmp_path):
    """What the database holds (written by an older provision, or by hand) is printed
    with its control characters shown, never interpreted."""
    store.create_token("mallory\x1b]0;OWNED\x07\nforged", admin=False)
    code, out, _ = run("serve", "token", "list", cwd=tmp_path)
    assert code == 0 and "mallory\\e]0;OWNED\\x07\\x0aforged" in out, out
    assert "\x1b" not in out and "\x07" not in out and len(out.splitlines()) == 2, out


def test_the_token_check_serves_the_dashboard(store, tmp_path):
    _, token = store.create_token("ana@example.com", admin=False)
    app = make_app(
        ServiceSource(store, tmp_path / "work"), auth=choose_auth(Listen("0.0.0.0", 8470), None, store, True)
    )
    c = TestClient(app, client=("10.1.2.3", 40000), base_url="http://127.0.0.1:8470")
    assert c.get("/api/v1/jobs").status_code == 401
    assert c.get("/api/v1/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    got = c.get("/api/v1/jobs", headers={"Authorization": f"Bearer {token}"})
    assert got.status_code == 200 and got.json()["jobs"] == []


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:8470", Listen("127.0.0.1", 8470)),
        ("0.0.0.0:80", Listen("0.0.0.0", 80)),
        ("[::1]:9000", Listen("::1", 9000)),
        ("none", None),
    ],
)
def test_parse_listen(text, want):
    assert parse_listen(text) == want


@pytest.mark.parametrize("text", ["8470", "host:", ":8470", "h:-1", "h:70000", "h:x", "h:\u00b2", "h:" + "9" * 5000])
def test_parse_listen_refused(text):
    with pytest.raises(ProvisionError, match="--listen"):
        parse_listen(text)


def test_which_auth_an_address_gets(store):
    loop, wide = Listen("127.0.0.1", 1), Listen("10.0.0.5", 1)
    assert choose_auth(loop, None, store, False).mode is Mode.LOOPBACK
    assert choose_auth(Listen("localhost", 1), None, store, False).mode is Mode.LOOPBACK
    assert choose_auth(Listen("::1", 1), "X-Forwarded-User", store, False).mode is Mode.HEADER
    assert choose_auth(wide, None, store, True).mode is Mode.TOKEN
    with pytest.raises(ProvisionError, match="provision serve token create --owner NAME"):
        choose_auth(wide, None, store, False)
    with pytest.raises(ProvisionError, match="--trust-header goes with a loopback"):
        choose_auth(wide, "X-Forwarded-User", store, True)


def test_serve_refuses_before_it_starts(store, tmp_path):
    code, _, err = run("serve", "--listen", "0.0.0.0:0", cwd=tmp_path)
    assert code != 0 and "provision serve token create --owner NAME" in err and len(err.strip().splitlines()) == 1
    code, _, err = run("serve", "--listen", "0.0.0.0:0", "--trust-header", "X-Forwarded-User", cwd=tmp_path)
    assert code != 0 and "--trust-header" in err
    code, _, err = run("serve", "--listen", "nowhere", cwd=tmp_path)
    assert code != 0 and "HOST:PORT" in err
    assert not store.services()  # none of them started the service


def test_usage_per_day_and_week_from_history():
    now = calendar.timegm((2026, 11, 27, 12, 0, 0))  # a Friday, noon UTC
    day = 86400.0
    events = [
        HistoryRow("run", "bert", "ana", now - day - 3600, now - day + 3600, "completed", ("h1",), 2),  # 2 GPUs x 2 h
        HistoryRow("trial", "s-t1", "bo", now - 1800, None, "", ("h1",), 1),  # still running: half an hour so far
        HistoryRow("wait", "bert", "ana", now - 3 * day, now - 2 * day, "started", (), 0),  # a wait holds nothing
    ]
    doc = usage_json(events, now)
    assert doc["format_version"] == 1 and doc["idle"] == []
    assert {(d["day"], d["owner"]): d["gpu_hours"] for d in doc["days"]} == {
        ("2026-11-26", "ana"): 4.0,
        ("2026-11-27", "bo"): 0.5,
    }
    assert {(w["week"], w["owner"]): w["gpu_hours"] for w in doc["weeks"]} == {
        ("2026-W48", "ana"): 4.0,
        ("2026-W48", "bo"): 0.5,
    }


def test_usage_summed_by_the_database_as_in_hand(store):
    """The service's Usage page sums in SQL (gpu_hours_in): the same figures as gpu_hours
    over the rows, a row across two days split between them, an open one until now."""
    now = calendar.timegm((2026, 11, 27, 12, 0, 0))
    day = 86400.0
    events = [
        HistoryRow("run", "bert", "ana", now - day - 3600, now - day + 3600, "completed", ("h1",), 2),
        HistoryRow(
            "run", "gpt", "ana", now - 12 * 3600 - 1800, now - 11 * 3600, "completed", ("h1",), 8
        ),  # across midnight
        HistoryRow("trial", "s-t1", "bo", now - 1800, None, "", ("h1",), 1),
        HistoryRow("wait", "bert", "ana", now - 3 * day, now - 2 * day, "started", (), 0),
        HistoryRow("run", "old", "cy", now - 90 * day, now - 89 * day, "completed", ("h1",), 4),  # before every window
    ]
    for e in events:
        store.record(e)
    wins = usage_windows(now)
    uses = [Use(e.owner, e.kind, e.gpus, e.started, e.ended) for e in events]
    want = [gpu_hours(uses, end, start) for _, _, start, end in wins]
    got = store.gpu_hours_in([(w[2], w[3]) for w in wins], now, sorted(HOLDING))
    assert [{o: round(h, 6) for o, h in d.items()} for d in got] == [
        {o: round(h, 6) for o, h in d.items()} for d in want
    ]
    assert any(d for d in got)


def test_the_usage_page_is_summed_once_for_a_few_seconds(store, tmp_path, monkeypatch):
    """One sum of the history answers the next USAGE_FRESH s (it says when it was made)."""
    src = ServiceSource(store, tmp_path / "work")
    sums: list[int] = []
    real = store.gpu_hours_in
    monkeypatch.setattr(store, "gpu_hours_in", lambda *a: sums.append(1) or real(*a))
    first = src.usage()
    assert src.usage() is first and len(sums) == 1
    assert set(first) == {"format_version", "days", "weeks", "idle", "as_of"} and first["as_of"].endswith("Z")


def test_cancel_from_the_dashboard_takes_back_a_waiting_submission(store, tmp_path):
    sub = Submission("s1", Kind.APPLY, "bert", "ana", "local", "", "inv.yaml", {})
    store.submit(sub)
    src = ServiceSource(store, tmp_path / "work")
    assert src.owner("bert") == "ana"
    got = src.cancel("bert", "ops")
    assert got["ok"] and "Took back s1" in got["message"]
    assert not src.cancel("bert", "ops")["ok"]


def test_install_keeps_the_pages_options(tmp_path, monkeypatch):
    from provision.cli import servecmd  # (the module whose unit.install is replaced)

    got: list[list[str]] = []
    monkeypatch.setattr(servecmd.unit, "install", lambda args, user: got.append(list(args)) or ["installed"])
    code, out, err = run("serve", "--install", "--listen", "0.0.0.0:8470", "--inventory", "a.yaml", cwd=tmp_path)
    assert code == 0 and "installed" in out, err
    assert got == [["--poll", "1", "--listen", "0.0.0.0:8470", "--inventory", str(tmp_path.resolve() / "a.yaml")]]
    code, _, err = run("serve", "--install", "--public-url", "https://dash.example.com/", cwd=tmp_path)
    assert code == 0, err
    assert got[-1] == ["--poll", "1", "--listen", "127.0.0.1:8470", "--public-url", "https://dash.example.com/"]
