"""Telling people: each notification rule (core/notify.py, io/servicenotify.py) is a
subscriber of the event stream of its own (serve/stream.Delivery: its thread, its cursor),
so an endpoint that fails or hangs delays only its own rule: never another rule, the
history, or the service's round. While the service leads, Notifications starts a Delivery
for every rule in the database and ends the Delivery of a rule removed (it looks again
every few seconds: `provision notify add` needs no restart).

At least once, in order: an event is sent, then the cursor moves past it; a rule that fails
midway moves its cursor to just before the event that failed and has the rest again after
the Delivery's growing pause. A service killed between a send and the cursor's move, or a
new leader, sends those events again: each carries its id (the X-Provision-Event header,
the body's `event.id`, the mail's Message-ID) so that a receiver drops a repeat.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from provision import __version__
from provision.core.errors import ProvisionError
from provision.core.events import Event, How, Kind, Stored
from provision.core.notify import Channel, Relay, Rule
from provision.io import notifysend
from provision.io.servicestore import ServiceStore
from provision.rules import notify
from provision.serve.stream import RETRY, Delivery

RULES_EVERY = 2.0  # seconds between two looks at the rules
# Each rule sends at most RATE events a second after a first BURST at once: a backlog of
# thousands (a service back after a long outage) neither starves the service's round of
# the CPU nor floods a receiver (Slack takes about one message a second per webhook).
RATE = 100.0
BURST = 100


class Sender:
    """The network side (io/notifysend.py); tests give a stand-in."""

    def poster(self, url: str) -> notifysend.Poster:
        return notifysend.Poster(url)

    def mailer(self, relay: Relay, password: str | None) -> notifysend.Mailer:
        return notifysend.Mailer(relay, password)


class Pace:
    """A token bucket: at most `rate` sends a second, `burst` at once; once empty, sends go
    in clumps of `clump` (fewer wake-ups than one send every 1/rate s)."""

    def __init__(
        self, rate: float = RATE, burst: int = BURST, clump: int = 10, clock: Callable[[], float] = time.monotonic
    ):
        self.rate, self.burst, self.clump, self.clock = rate, float(burst), float(min(clump, burst)), clock
        self.tokens, self.at = float(burst), clock()

    def wait(self) -> float:
        """0: a send may go now (it is counted); else the seconds to wait before asking again."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (self.clump - self.tokens) / self.rate


class _Stopped(Exception):
    """The Delivery stops (or the lead is gone) midway through a batch: the rest waits for
    whoever delivers next (the cursor is just before it)."""


class RuleHandler:
    """One rule's subscriber: each of its events sent once it matches the rule."""

    from_start = False  # never used: the rule's cursor is set when it is added

    def __init__(
        self,
        store: ServiceStore,
        rule: Rule,
        public_url: str | None,
        env: Mapping[str, str],
        sender: Sender,
        go_on: Callable[[], bool] = lambda: True,
        env_is: str = "the service's environment: start it with it set",
        pace: Pace | None = None,
    ):
        self.store, self.rule, self.public_url, self.env, self.sender = store, rule, public_url, env, sender
        self.env_is = env_is  # where a missing variable should be (the words of its error)
        self.name = rule.cursor
        self.go_on = go_on  # False: stop between two sends
        self.pace = pace or Pace()
        self.sent = 0

    def handle(self, events: Sequence[Stored]) -> None:
        todo = [s for s in events if notify.matches(self.rule, s)]
        if not todo:
            return
        at = todo[0]
        try:
            if self.rule.channel is Channel.EMAIL:
                with self._mailer() as m:
                    domain = m.relay.sender.rpartition("@")[2] or "provision"
                    for at in todo:
                        self._next()
                        m.send(notify.mail(at, self.rule, m.relay, self.public_url, domain))
                        self.sent += 1
            else:
                key = self._key()
                poster = self.sender.poster(self.rule.target)
                try:
                    for at in todo:
                        self._next()
                        poster.post(*self._request(at, key))
                        self.sent += 1
                finally:
                    poster.close()
        except (ProvisionError, _Stopped) as e:
            self.store.advance(self.name, at.id - 1)  # everything before `at` went
            if isinstance(e, ProvisionError):
                raise ProvisionError(f"{self.rule.channel.value}: {e.message}") from None
            raise

    def _next(self) -> None:
        """The next send may go: after its pace's wait, unless the delivery stops."""
        while (wait := self.pace.wait()) > 0 and self.go_on():
            time.sleep(wait)
        if not self.go_on():
            raise _Stopped()

    def _key(self) -> bytes | None:
        name = self.rule.secret_env
        if self.rule.channel is not Channel.WEBHOOK or not name:
            return None
        value = self.env.get(name)
        if not value:
            raise ProvisionError(f"{name} (its signing key) is not in {self.env_is}")
        return value.encode()

    def _request(self, s: Stored, key: bytes | None, test: bool = False) -> tuple[bytes, dict[str, str]]:
        if self.rule.channel is Channel.SLACK:
            body = notify.chat_body(s, self.public_url)
        else:
            body = notify.webhook_body(s, self.rule, self.public_url, test=test)
        return body, notify.headers(s, self.rule, body, key, __version__)

    def _mailer(self) -> notifysend.Mailer:
        relay = self.store.relay()
        if relay is None:
            raise ProvisionError("no SMTP relay is set (`provision notify smtp`)")
        password = None
        if relay.user:
            password = self.env.get(relay.password_env)
            if not password:
                raise ProvisionError(f"{relay.password_env} (the relay's password) is not in {self.env_is}")
        return self.sender.mailer(relay, password)

    def test(self, s: Stored) -> str:
        """One event sent now, whatever the rule picks (`provision notify test`): what
        answered, in words."""
        try:
            if self.rule.channel is Channel.EMAIL:
                with self._mailer() as m:
                    domain = m.relay.sender.rpartition("@")[2] or "provision"
                    m.send(notify.mail(s, self.rule, m.relay, self.public_url, domain))
                return f"the relay {m.relay.host}:{m.relay.port} took it"
            poster = self.sender.poster(self.rule.target)
            try:
                status = poster.post(*self._request(s, self._key(), test=True))
            finally:
                poster.close()
            return f"answered {status}"
        except ProvisionError as e:
            raise ProvisionError(f"rule {self.rule.id} ({self.rule.channel.value}): {e.message}") from None


def sample(rule: Rule, who: str, now: float) -> Stored:
    """The event `provision notify test` sends: id 0 (no event of the stream has it)."""
    words = f"job provision-test succeeded: a test of notification rule {rule.id} by {who}"
    event = Event(Kind.JOB_ENDED, f"test:{rule.id}", "provision-test", who, words=words, how=How.SUCCEEDED)
    return Stored(0, now, event)


class Notifications:
    """A Delivery per rule while leading (module docstring). Quacks as a Delivery for
    cli/servecmd.py: start, wake (new events: every rule delivers now), stop."""

    name = "notifications"

    def __init__(
        self,
        store: ServiceStore,
        leading: threading.Event,
        say: Callable[[str], None],
        public_url: str | None = None,
        *,
        every: float = RULES_EVERY,
        retry: Sequence[float] = RETRY,
        rate: float = RATE,
        env: Mapping[str, str] | None = None,
        sender: Sender | None = None,
        own_store: bool = True,
    ):
        self.store, self.leading, self.say, self.public_url = store, leading, say, public_url
        self.every, self.retry, self.rate = every, tuple(retry), rate
        self.env = env if env is not None else os.environ
        self.sender = sender or Sender()
        self.own_store = own_store  # closed by stop()
        self.deliveries: dict[str, Delivery] = {}
        self.ending: dict[str, Delivery] = {}  # the deliveries of rules removed, until their thread ends
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="notifications", daemon=True)
        self._failing = False

    def start(self) -> None:
        self.thread.start()

    def wake(self) -> None:
        for d in list(self.deliveries.values()):
            d.wake()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)
        _end(list(self.deliveries.values()), join=notifysend.TIMEOUT + 2)
        self.deliveries.clear()
        if self.own_store:
            self.store.close()

    def run(self) -> None:
        while not self.stopping.is_set():
            if self.leading.is_set():
                try:
                    self.sync()
                except Exception as e:  # the database away: said once, the deliveries go on
                    if not self._failing:
                        why = e.message if isinstance(e, ProvisionError) else f"{type(e).__name__}: {e}"
                        self.say(f"notifications: cannot read the rules: {why}")
                    self._failing = True
                else:
                    if self._failing:
                        self.say("notifications: the rules are read again")
                    self._failing = False
            self.stopping.wait(self.every)

    def sync(self) -> None:
        """A Delivery for each rule in the database; none for a rule that is gone."""
        rules = {r.id: r for r in self.store.rules()}
        for rid, d in list(self.ending.items()):
            if not d.thread.is_alive():  # its last move of the cursor is made: take it away
                self.store.forget_cursor(d.handler.name)
                del self.ending[rid]
        gone = {rid: d for rid, d in self.deliveries.items() if rid not in rules}
        for rid in gone:
            del self.deliveries[rid]
        _end(list(gone.values()), join=0)  # a hanging endpoint's thread ends when its request does
        self.ending |= gone
        for rid, rule in rules.items():
            if rid not in self.deliveries and not self.stopping.is_set():
                self.deliveries[rid] = d = self._delivery(rule)
                d.start()

    def _delivery(self, rule: Rule) -> Delivery:
        handler = RuleHandler(self.store, rule, self.public_url, self.env, self.sender, pace=Pace(self.rate))
        d = Delivery(self.store, handler, self.leading, self.say, retry=self.retry)
        handler.go_on = lambda: self.leading.is_set() and not d.stopping.is_set()
        return d


def _end(deliveries: list[Delivery], join: float) -> None:
    """Stop them all at once, and wait at most `join` seconds for them all together."""
    for d in deliveries:
        d.stopping.set()
        d.woken.set()
    until = time.monotonic() + join
    for d in deliveries:
        d.thread.join(timeout=max(0.0, until - time.monotonic()))
