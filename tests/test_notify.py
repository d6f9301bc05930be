"""Notifications (core/notify.py, rules/notify.py, io/servicenotify.py, io/notifysend.py,
serve/notify.py, cli/notifycmd.py), against receivers on loopback (tests/notifyhelp.py):
an HTTP server in the test and a real SMTP server (aiosmtpd) that requires STARTTLS with a
self-signed certificate and a login.

- the rules' words and checks, as tables;
- each channel delivered: the chat webhook's {"text"}, the JSON webhook signed (the HMAC is
  verified here), mail through the relay;
- at least once and never doubled beyond its id: a receiver that answers 500, then 200,
  gets every event once it is back, each once, in order; a hanging one delays no other rule;
- secrets stay secret: no URL path in `notify list` (nor its JSON), in an error, or in
  the service's log;
- bad input is one line and nothing is stored (an unknown kind, a URL that is not
  http(s), a relay that refuses the login).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from clirun import run, wait_until
from notifyhelp import Receiver, SmtpSink, self_signed
from provision.core.events import Event, How, Kind, Stored, best_key
from provision.core.notify import Channel, Relay, Rule
from provision.core.tuning import Goal, Metric, TrialRow, TrialState, new_best
from provision.io import notifysend
from provision.io.servicestore import ServiceRow, ServiceStore
from provision.rules import notify
from provision.rules.tenancy import identity
from provision.serve.notify import Notifications, Pace, Sender

SECRET = "SECRET-PATH-TOKEN"  # in every webhook URL here: it must never be printed


@pytest.fixture(autouse=True)
def _db(tmp_path, monkeypatch):
    monkeypatch.setenv("PROVISION_SERVICE_DB", str(tmp_path / "svc" / "service.sqlite"))
    monkeypatch.setenv("PROVISION_OWNER", "ann@example.com")
    identity.cache_clear()
    yield
    identity.cache_clear()


@pytest.fixture
def store(tmp_path):
    s = ServiceStore.open_local(tmp_path / "svc" / "service.sqlite")
    yield s
    s.close()


@pytest.fixture
def pg_store(postgres, monkeypatch):
    monkeypatch.setenv("PGPASSWORD", postgres.env()["PGPASSWORD"])
    drop = (
        "DROP TABLE IF EXISTS provision_service_notify, provision_service_smtp, provision_service_events, "
        "provision_service_cursors"
    )
    postgres.sql(drop)
    s = ServiceStore.open_pg(postgres.url(), "pg")
    yield s
    s.close()
    postgres.sql(drop)  # the session's other tests find the stream as they left it: empty


@pytest.fixture(params=["sqlite", "postgresql"])
def both(request):
    return request.getfixturevalue("store" if request.param == "sqlite" else "pg_store")


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def ended(n: int, owner: str = "ann@example.com", job: str | None = None) -> Event:
    job = job or f"bert-{n}"
    words = f"job {job} failed: chief-0 exited 3"
    return Event(Kind.JOB_ENDED, f"end:{job}:{n}", job, owner, "gpu-1", words, How.FAILED, 1, ("gpu-1",), 2)


def stored(e: Event, i: int = 7) -> Stored:
    return Stored(i, 1_800_000_000.0, e)


# --------------------------------------------------------------------------- tables


@pytest.mark.parametrize(
    "url, why",
    [
        ("https://hooks.slack.com/services/T0/B0/XYZ", None),
        ("http://127.0.0.1:8080/hook", None),
        ("http://[::1]:9/x", None),
        ("ftp://example.com/x", "not an http(s) URL"),
        ("hooks.slack.com/services/T0/B0/XYZ", "not an http(s) URL"),
        ("https:///nohost", "no host"),
        ("https://user:pw@example.com/x", "a user or password in the URL is not taken"),
        ("https://example.com/a b", "a space or a control"),
        ("https://example.com:99999/x", "its host or port cannot be read"),
        ("https://example.com/" + "x" * 3000, "longer than 2048"),
    ],
)
def test_a_webhook_url_is_http_or_https_with_a_host(url: str, why: str | None) -> None:
    got = notify.url_problem(url)
    assert (got is None) if why is None else (got is not None and why in got), got
    if got is not None:
        assert "XYZ" not in got and "pw" not in got  # the error never repeats the URL


@pytest.mark.parametrize(
    "url, shown",
    [
        ("https://hooks.slack.com/services/T0/B0/XYZ", "https://hooks.slack.com/…"),
        ("http://127.0.0.1:8080/hook?token=abc", "http://127.0.0.1:8080/…"),
        ("http://[::1]:9/x", "http://[::1]:9/…"),
        ("https://example.com", "https://example.com/…"),
    ],
)
def test_a_url_is_shown_as_its_scheme_and_host(url: str, shown: str) -> None:
    assert notify.masked(url) == shown


@pytest.mark.parametrize(
    "address, ok",
    [("ann@example.com", True), ("ops+ml@lab.example.org", True), ("ann", False), ("a@b.c, evil@x.y", False),
     ("ann@example.com\nBcc: x@y.z", False), ("Ann <ann@example.com>", False)],
)  # fmt: skip
def test_an_address_is_one_mail_address(address: str, ok: bool) -> None:
    assert (notify.address_problem(address) is None) is ok


R = Rule("r1", Channel.SLACK, "https://x/y")


@pytest.mark.parametrize(
    "rule, event, want",
    [
        (R, ended(1), True),
        (Rule("r1", Channel.SLACK, "u", kinds=(Kind.JOB_ENDED,)), ended(1), True),
        (Rule("r1", Channel.SLACK, "u", kinds=(Kind.JOB_STARTED,)), ended(1), False),
        (Rule("r1", Channel.SLACK, "u", owner="ann@example.com"), ended(1), True),
        (Rule("r1", Channel.SLACK, "u", owner="bob@example.com"), ended(1), False),
        (Rule("r1", Channel.SLACK, "u", job="bert-*"), ended(1), True),
        (Rule("r1", Channel.SLACK, "u", job="gpt-*"), ended(1), False),
        (Rule("r1", Channel.SLACK, "u", job="bert-*"), Event(Kind.HOST_BACK, "back:h:1", host="h"), False),
        (Rule("r1", Channel.SLACK, "u", kinds=(Kind.HOST_BACK,)), Event(Kind.HOST_BACK, "back:h:1", host="h"), True),
    ],
)
def test_a_rule_picks_events_by_kind_owner_and_job(rule: Rule, event: Event, want: bool) -> None:
    assert notify.matches(rule, stored(event)) is want


def test_the_message_says_what_whose_how_and_links_its_page() -> None:
    m = notify.message(stored(ended(1)), "https://ml.example.org/provision/")
    assert m.title == "job bert-1 failed: chief-0 exited 3"
    assert m.lines[0] == "owner ann@example.com · how: failed · on gpu-1 · 2 GPUs"
    assert m.link == "https://ml.example.org/provision/jobs/bert-1" and m.link in m.lines
    assert m.lines[-1] == "event 7 (job.ended) at 2027-01-15T08:00:00Z"
    best = Event(Kind.STUDY_BEST, best_key("sweep", 3), "sweep", "ann", words="study sweep: trial 3 is the best so far")
    assert notify.link("https://d/", stored(best)) == "https://d/studies/sweep"
    assert notify.message(stored(ended(1))).link is None  # no public address: no link


def test_chat_text_cannot_ping_or_link() -> None:
    e = Event(Kind.TASK_FAILED, "fail:x", "x", "ann@example.com", words="<!channel> @here <https://evil|click> & co")
    text = json.loads(notify.chat_body(stored(e), None))["text"]
    assert "<!channel>" not in text and "<https://evil" not in text and "&lt;!channel&gt;" in text
    assert "@here" not in text and "@\u200bhere" in text
    assert "ann@example.com" in text  # an @ inside a word stays


@pytest.mark.parametrize(
    "values, best",
    [([0.5, 0.7, 0.3, 0.3, 0.1], {1, 3, 5}), ([None, 0.4, 0.4], {2})],
)
def test_a_new_best_beats_every_trial_before_it(values: list[float | None], best: set[int]) -> None:
    metric = Metric("loss", Goal.MINIMIZE)
    rows: list[TrialRow] = []
    got = set()
    for n, v in enumerate(values, 1):
        state = TrialState.SUCCEEDED if v is not None else TrialState.FAILED
        r = TrialRow(n, (), state, v)
        rows.append(r)
        if new_best(rows, r, metric):
            got.add(n)
    assert got == best


# --------------------------------------------------------------------------- the store


def test_a_rule_begins_at_the_streams_end_and_goes_with_its_cursor(both: ServiceStore) -> None:
    store = both
    store.emit([ended(1), ended(2)])
    rule = store.add_rule(Rule("r1", Channel.WEBHOOK, "http://h/x", kinds=(Kind.JOB_ENDED,), secret_env="K"))
    assert store.cursor(rule.cursor) == store.last_event_id() > 0
    assert store.rules() == [rule] and rule.created > 0 and rule.kinds == (Kind.JOB_ENDED,)
    assert "http://h/x" not in repr(rule)  # the URL stays out of any traceback or log of the rule
    assert store.remove_rule("r1") and store.cursor("notify:r1") is None and store.rules() == []
    assert not store.remove_rule("r1")
    store.set_relay(Relay("smtp.example.org", 587, "ml@example.org", "bot", "SMTP_PW"))
    store.set_relay(Relay("smtp.example.org", 2525, "ml@example.org", "bot", "SMTP_PW"))
    assert store.relay() == Relay("smtp.example.org", 2525, "ml@example.org", "bot", "SMTP_PW")


# --------------------------------------------------------------------------- delivery


class QuickSender(Sender):
    """The real network side with a short request timeout (a hanging receiver in a test)
    and the test's certificate trusted."""

    def __init__(self, timeout: float = notifysend.TIMEOUT, cafile: Path | None = None):
        self.timeout, self.cafile = timeout, cafile

    def poster(self, url: str) -> notifysend.Poster:
        return notifysend.Poster(url, timeout=self.timeout)

    def mailer(self, relay: Relay, password: str | None) -> notifysend.Mailer:
        import ssl

        ctx = ssl.create_default_context(cafile=str(self.cafile)) if self.cafile else None
        return notifysend.Mailer(relay, password, timeout=self.timeout, context=ctx)


def _notifications(store: ServiceStore, said: list[str], **kw: Any) -> Notifications:
    leading = threading.Event()
    leading.set()
    kw.setdefault("sender", QuickSender())
    n = Notifications(store, leading, said.append, "https://ml.example.org", every=0.1, own_store=False, **kw)
    n.start()
    return n


def test_each_channel_is_delivered_the_webhook_signed(store: ServiceStore, receiver: Receiver) -> None:
    chat = store.add_rule(Rule("chat", Channel.SLACK, receiver.url(f"/chat/{SECRET}"), kinds=(Kind.JOB_ENDED,)))
    hook = store.add_rule(Rule("hook", Channel.WEBHOOK, receiver.url(f"/hook/{SECRET}"), secret_env="HOOK_KEY"))
    said: list[str] = []
    n = _notifications(store, said, env={"HOOK_KEY": "k3y"})
    try:
        store.emit([ended(1), Event(Kind.HOST_BACK, "back:gpu-1:1", host="gpu-1", words="gpu-1 answers again")])
        n.wake()
        wait_until(lambda: len(receiver.taken()) == 3, 10, 0.05, what="three posts")
    finally:
        n.stop()
    got = receiver.taken()
    chats = [g for g in got if g.path.startswith("/chat/")]
    hooks = [g for g in got if g.path.startswith("/hook/")]
    assert len(chats) == 1 and len(hooks) == 2  # the chat rule takes job.ended only
    text = chats[0].doc["text"]
    assert text.startswith("job bert-1 failed: chief-0 exited 3\nowner ann@example.com · how: failed")
    assert "https://ml.example.org/jobs/bert-1" in text and chats[0].headers["x-provision-rule"] == chat.id
    assert chats[0].headers["x-provision-event"] == "1" and "x-provision-signature" not in chats[0].headers
    for g in hooks:
        assert g.signed_by(b"k3y"), g.headers  # a receiver verifies the HMAC-SHA256 of the body
        assert not g.signed_by(b"another key")
        assert g.headers["x-provision-event"] == str(g.doc["event"]["id"]) and g.doc["rule"] == hook.id
    assert [g.doc["event"]["kind"] for g in hooks] == ["job.ended", "host.back"]
    assert hooks[0].doc["link"] == "https://ml.example.org/jobs/bert-1" and hooks[0].doc["test"] is False
    assert store.cursor(chat.cursor) == store.cursor(hook.cursor) == 2
    assert not said, said


def test_a_receiver_that_fails_gets_every_event_once_it_is_back(store: ServiceStore) -> None:
    """500 for a while (a short outage: the retry schedule is shortened too), then 200:
    every event arrives, in order, each taken once (a 500 is not a delivery); the log says
    the failure once and the recovery once, naming the rule and never its URL."""
    back = threading.Event()
    r = Receiver(answer=lambda n: 200 if back.is_set() else 500)
    try:
        rule = store.add_rule(Rule("flaky", Channel.WEBHOOK, r.url(f"/x/{SECRET}")))
        said: list[str] = []
        n = _notifications(store, said, retry=(0.05, 0.1, 0.2))
        try:
            store.emit([ended(i) for i in range(1, 31)])
            n.wake()
            wait_until(lambda: len(r.got) >= 4, 10, 0.05, what="the failing posts")
            store.emit([ended(i) for i in range(31, 41)])  # more while it fails
            back.set()
            wait_until(lambda: len(r.taken()) >= 40, 20, 0.05, what="every event after the outage")
            time.sleep(0.5)  # nothing more should come
        finally:
            n.stop()
        ids = [g.doc["event"]["id"] for g in r.taken()]
        assert ids == list(range(1, 41)), ids
        assert store.cursor(rule.cursor) == 40
        assert said == [
            "events to notify:flaky: not delivered (webhook: answered 500); trying again, less and less often",
            "events to notify:flaky: delivered again",
        ], said
    finally:
        r.close()


def test_a_hanging_endpoint_delays_no_other_rule(store: ServiceStore, receiver: Receiver) -> None:
    hang = threading.Event()
    stuck = Receiver(hang=hang)
    try:
        store.add_rule(Rule("stuck", Channel.WEBHOOK, stuck.url()))
        store.add_rule(Rule("fine", Channel.SLACK, receiver.url()))
        said: list[str] = []
        n = _notifications(store, said, sender=QuickSender(timeout=30.0))
        try:
            for i in range(1, 4):
                store.emit([ended(i)])
                n.wake()
                t0 = time.monotonic()
                wait_until(lambda n=i: len(receiver.taken()) == n, 10, 0.02, what=f"event {i} to the other rule")
                assert time.monotonic() - t0 < 5.0  # not the 30 s the other waits (a loaded machine: not 2 s)
            assert not stuck.got  # still hanging on its first event
        finally:
            hang.set()
            n.stop()
    finally:
        stuck.close()


def test_a_post_is_cut_off_at_its_timeout_and_said_without_the_url(store: ServiceStore) -> None:
    hang = threading.Event()
    stuck = Receiver(hang=hang)
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception) as e:
            notifysend.post(stuck.url(), b"{}", {}, timeout=0.5)
        assert time.monotonic() - t0 < 5
        assert str(e.value) == "no answer within 0.5 s"
    finally:
        stuck.close()
    with pytest.raises(Exception) as e:
        notifysend.post(f"http://127.0.0.1:1/{SECRET}", b"{}", {}, timeout=2)
    assert str(e.value) == "connection refused" and SECRET not in str(e.value)


def test_a_removed_rule_sends_nothing_more_and_a_new_one_only_what_follows(
    store: ServiceStore, receiver: Receiver
) -> None:
    store.emit([ended(1)])  # before any rule: never sent
    store.add_rule(Rule("one", Channel.WEBHOOK, receiver.url()))
    said: list[str] = []
    n = _notifications(store, said)
    try:
        store.emit([ended(2)])
        n.wake()
        wait_until(lambda: len(receiver.taken()) == 1, 10, 0.05, what="event 2")
        assert store.remove_rule("one")
        wait_until(lambda: "one" not in n.deliveries and not n.ending, 10, 0.05, what="its delivery to end")
        assert store.cursor("notify:one") is None
        store.emit([ended(3)])
        n.wake()
        time.sleep(0.5)
    finally:
        n.stop()
    assert [g.doc["event"]["id"] for g in receiver.taken()] == [2]


def test_mail_goes_through_the_relay_with_starttls_and_a_login(tmp_path: Path, store: ServiceStore) -> None:
    cert, key = self_signed(tmp_path / "tls")
    sink = SmtpSink(cert, key)
    try:
        store.set_relay(Relay("127.0.0.1", sink.port, "provision@ml.example.org", "bot", "SMTP_PW"))
        rule = store.add_rule(Rule("mail", Channel.EMAIL, "ann@example.com", kinds=(Kind.JOB_ENDED,)))
        said: list[str] = []
        n = _notifications(store, said, env={"SMTP_PW": "s3cret-pw"}, sender=QuickSender(cafile=cert))
        try:
            store.emit([ended(1), ended(2)])
            n.wake()
            wait_until(lambda: len(sink.messages) == 2, 15, 0.05, what="two mails")
        finally:
            n.stop()
        m = sink.messages[0]
        assert m["Subject"] == "[provision] job bert-1 failed: chief-0 exited 3"
        assert m["From"] == "provision@ml.example.org" and m["To"] == "ann@example.com"
        assert m["Message-ID"] == f"<provision.1.{rule.id}@ml.example.org>" and m["X-Provision-Event"] == "1"
        assert "https://ml.example.org/jobs/bert-1" in m.get_content()
        assert sink.logins and all(ok for _, ok in sink.logins) and not said
    finally:
        sink.close()


# --------------------------------------------------------------------------- the commands


def _one_line_error(code: int, out: str, err: str, words: str) -> None:
    assert code == 1 and not out, (code, out, err)
    assert err.count("\n") == 1 and err.startswith("Error: ") and words in err, err


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["--events", "job.ended,job.exploded", "--slack", f"https://h/{SECRET}"],
            "'job.exploded' is not an event kind",
        ),
        (["--events", "nope.*", "--slack", f"https://h/{SECRET}"], "'nope.*' is not an event kind"),
        (["--slack", f"ftp://h/{SECRET}"], "--slack: not an http(s) URL"),
        (["--webhook", f"h/{SECRET}"], "--webhook: not an http(s) URL"),
        (["--slack", f"https://h/{SECRET}", "--email", "a@b.c"], "give one of --slack URL, --webhook URL or --email"),
        (["--slack", f"https://h/{SECRET}", "--secret-env", "K"], "--secret-env goes with --webhook"),
        (["--webhook", f"https://h/{SECRET}", "--secret-env", "1BAD"], "--secret-env: not an environment"),
        (["--email", "not-an-address"], "--email: not one mail address"),
        (["--email", "ann@example.com"], "no SMTP relay is set"),
        (["--job", "", "--slack", f"https://h/{SECRET}"], "--job:"),
    ],
)
def test_a_bad_rule_is_one_line_and_nothing_is_stored(tmp_path: Path, args: list[str], words: str) -> None:
    code, out, err = run("notify", "add", *args, cwd=tmp_path)
    _one_line_error(code, out, err, words)
    assert SECRET not in err
    s = ServiceStore.open_local()
    try:
        assert s.rules() == []
    finally:
        s.close()


def test_list_shows_scheme_and_host_never_the_path(tmp_path: Path) -> None:
    code, out, err = run("notify", "add", "--owner", "ann@example.com", "--events", "job.*,gpu.quarantined",
                         "--slack", f"https://hooks.slack.com/services/T0/{SECRET}", cwd=tmp_path)  # fmt: skip
    assert code == 0, err
    rid = out.split()[2].rstrip(":")
    assert out.startswith(f"Added rule {rid}: job.started, job.ended, job.preempted, job.resumed, job.recovered, job.scaled, "
                          "gpu.quarantined of ann@example.com's work to slack https://hooks.slack.com/…, from now on.")  # fmt: skip
    code, listed, _ = run("notify", "list", cwd=tmp_path)
    code2, doc, _ = run("notify", "list", "--json", cwd=tmp_path)
    assert code == code2 == 0
    assert SECRET not in out + listed + doc and "/services" not in listed + doc
    assert f"{rid}  slack https://hooks.slack.com/…" in listed
    rule = json.loads(doc)["rules"][0]
    assert rule["to"] == "https://hooks.slack.com/…" and rule["owner"] == "ann@example.com"
    assert rule["events"][-1] == "gpu.quarantined" and rule["created_by"] == "ann@example.com"
    # From stdin: the URL never on a command line (nor in the shell's history).
    from provision.cli.app import main

    r = CliRunner().invoke(main, ["notify", "add", "--webhook", "-"], input=f"http://127.0.0.1:9/{SECRET}\n")
    assert r.exit_code == 0 and SECRET not in r.stdout and "webhook http://127.0.0.1:9/…" in r.stdout, r.stdout
    assert "Note: unsigned" in r.stdout
    code, out, _ = run("notify", "remove", rid, cwd=tmp_path)
    assert code == 0 and out == f"Removed rule {rid}.\n"
    _one_line_error(*run("notify", "remove", rid, cwd=tmp_path), f"no rule {rid}")


def test_notify_test_sends_one_signed_sample_and_says_the_answer(tmp_path, monkeypatch, receiver) -> None:
    code, out, err = run("notify", "add", "--webhook", receiver.url(), "--secret-env", "HOOK_KEY", cwd=tmp_path)
    assert code == 0, err
    rid = out.split()[2].rstrip(":")
    _one_line_error(*run("notify", "test", rid, cwd=tmp_path), "HOOK_KEY (its signing key) is not in this shell's")
    monkeypatch.setenv("HOOK_KEY", "k3y")
    code, out, err = run("notify", "test", rid, cwd=tmp_path)
    assert code == 0, err
    to = notify.masked(receiver.url())
    assert out == f"Rule {rid}: a test event went to webhook {to}, signed with $HOOK_KEY: answered 200.\n"
    got = receiver.taken()[-1]
    assert got.signed_by(b"k3y") and got.doc["test"] is True and got.doc["event"]["id"] == 0
    receiver.answer = lambda n: 503
    _one_line_error(*run("notify", "test", rid, cwd=tmp_path), f"rule {rid} (webhook): answered 503")


def test_the_relay_is_set_after_its_login_and_a_refused_login_stores_nothing(tmp_path, monkeypatch) -> None:
    cert, key = self_signed(tmp_path / "tls")
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the CLI trusts the sink's certificate
    sink = SmtpSink(cert, key)
    try:
        base = ["notify", "smtp", "--host", "127.0.0.1", "--port", str(sink.port), "--user", "bot",
                "--password-env", "SMTP_PW", "--from", "provision@ml.example.org"]  # fmt: skip
        _one_line_error(*run(*base, cwd=tmp_path), "--password-env SMTP_PW: not set here")
        monkeypatch.setenv("SMTP_PW", "wrong")
        _one_line_error(*run(*base, cwd=tmp_path), "the relay refused the login of bot (535); nothing stored")
        s = ServiceStore.open_local()
        try:
            assert s.relay() is None
        finally:
            s.close()
        monkeypatch.setenv("SMTP_PW", "s3cret-pw")
        code, out, err = run(*base, cwd=tmp_path)
        assert code == 0, err
        assert out == (
            f"SMTP relay set: 127.0.0.1:{sink.port} as bot (password from $SMTP_PW), from provision@ml.example.org "
            "(login checked).\n"
        )
        code, out, err = run("notify", "add", "--email", "ann@example.com", "--events", "job.ended", cwd=tmp_path)
        assert code == 0, err
        rid = out.split()[2].rstrip(":")
        code, out, err = run("notify", "test", rid, cwd=tmp_path)
        assert code == 0 and out.endswith("took it.\n"), (out, err)
        assert sink.messages[-1]["Subject"].startswith("[provision] job provision-test succeeded")
        code, listed, _ = run("notify", "list", cwd=tmp_path)
        code2, doc, _ = run("notify", "list", "--json", cwd=tmp_path)
        assert "s3cret-pw" not in listed + doc and f"SMTP relay: 127.0.0.1:{sink.port} as bot" in listed
        s = ServiceStore.open_local()
        try:
            dump = "\n".join(s._conn.iterdump())
        finally:
            s.close()
        assert "s3cret-pw" not in dump  # never stored
    finally:
        sink.close()


def test_a_password_never_crosses_the_network_in_clear(tmp_path: Path, monkeypatch) -> None:
    """A relay that offers no STARTTLS gets no login, unless it is on loopback."""
    cert, key = self_signed(tmp_path / "tls")
    sink = SmtpSink(cert, key, tls=False)
    try:
        relay = Relay("127.0.0.1", sink.port, "provision@ml.example.org", "bot", "SMTP_PW")
        with notifysend.Mailer(relay, "s3cret-pw", timeout=5):
            pass  # loopback: the password stays on this machine
        assert sink.logins == [("bot", True)]
        monkeypatch.setattr(notifysend, "_loopback", lambda host: False)  # as a relay elsewhere would be
        with pytest.raises(Exception) as e:
            with notifysend.Mailer(relay, "s3cret-pw", timeout=5):
                pass
        assert str(e.value) == "the relay offers no STARTTLS: its password would cross the network in clear"
        assert len(sink.logins) == 1
    finally:
        sink.close()


def test_a_key_the_running_service_lacks_is_refused_and_without_a_service_said(tmp_path: Path) -> None:
    code, out, err = run("notify", "add", "--webhook", f"https://h/{SECRET}", "--secret-env", "HOOK_KEY", cwd=tmp_path)
    assert code == 0 and out.endswith(
        "No service runs yet: `provision serve` delivers it; start it with HOOK_KEY set.\n"
    )
    s = ServiceStore.open_local()
    try:
        s.beat(ServiceRow("ml-vm:4242:ab", "ml-vm", 4242, "local", ("PATH", "OTHER_KEY"), True, 0.0))
        before = len(s.rules())
    finally:
        s.close()
    _one_line_error(
        *run("notify", "add", "--webhook", f"https://h/{SECRET}", "--secret-env", "HOOK_KEY", cwd=tmp_path),
        "--secret-env HOOK_KEY: the service on ml-vm (pid 4242) has no HOOK_KEY in its environment",
    )
    s = ServiceStore.open_local()
    try:
        assert len(s.rules()) == before
    finally:
        s.close()


def test_a_rule_is_paced_after_a_burst_in_clumps() -> None:
    """At most `rate` sends a second after the first `burst`: a backlog of thousands costs
    the service a steady trickle, not its CPU; once empty, sends go in clumps."""
    now = [0.0]
    pace = Pace(rate=100.0, burst=5, clump=2, clock=lambda: now[0])
    assert [pace.wait() for _ in range(5)] == [0.0] * 5  # the burst at once
    assert pace.wait() == pytest.approx(0.02)  # then wait for a clump of 2
    now[0] += 0.02
    assert [pace.wait() for _ in range(3)] == [0.0, 0.0, pytest.approx(0.02)]
    now[0] += 10.0  # idle a while: a full burst again, never more
    assert [pace.wait() for _ in range(6)][-2:] == [0.0, pytest.approx(0.02)]


@pytest.mark.parametrize("keep, connections", [("yes", 1), ("drop", 3)])
def test_a_burst_goes_on_one_kept_connection_and_a_dropped_one_is_opened_again(keep: str, connections: int) -> None:
    r = Receiver(keep=keep)
    try:
        p = notifysend.Poster(r.url(), timeout=5)
        try:
            assert [p.post(b"{}", {"Content-Type": "application/json"}) for _ in range(3)] == [200, 200, 200]
        finally:
            p.close()
        assert len(r.taken()) == 3 and len(r.connections) == connections
    finally:
        r.close()
