"""Notifications, judged and worded (pure): which rule an event is for, what a rule's
input must be, and what each channel is sent (core/notify.py: the rules; serve/notify.py
sends).

What a message says comes from the event: its words (the same as `provision status`
says), whose work, how it ended, and a link to its page when the service has a public
address. The words came from hosts and submitters: in chat they are escaped so that they
can neither link nor ping anyone.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from email.message import EmailMessage
from email.utils import formatdate
from urllib.parse import quote, urlsplit

from provision.core.events import Kind, Stored
from provision.core.notify import NOTIFY_FORMAT, Relay, Rule
from provision.core.text import printable

MAX_URL = 2048
MAX_ADDRESS = 254  # RFC 5321's path limit
MAX_SUBJECT = 200
SIGNATURE_HEADER = "X-Provision-Signature"  # sha256=HEX: HMAC-SHA256 of the body with the rule's key
EVENT_HEADER = "X-Provision-Event"  # the event's id: a receiver drops a repeat by it
RULE_HEADER = "X-Provision-Rule"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_ADDRESS = re.compile(r"[^\s@<>()\[\],;:\"\\]+@[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")
_PING = re.compile(r"(^|\s)@(?=\w)")


# --------------------------------------------------------------------------- input


def url_problem(url: str) -> str | None:
    """None when `url` can be a webhook's; else why not, in words that never repeat it."""
    if len(url) > MAX_URL:
        return f"longer than {MAX_URL} characters"
    if any(c.isspace() or not c.isprintable() for c in url):
        return "it holds a space or a control character"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "not a URL (its host or port cannot be read)"
    if parts.scheme not in ("http", "https"):
        return "not an http(s) URL"
    if not parts.hostname:
        return "no host"
    if parts.username is not None or parts.password is not None:
        return "a user or password in the URL is not taken (a webhook carries its secret in its path)"
    if port == 0:
        return "port 0"
    return None


def masked(url: str) -> str:
    """A webhook's URL as it may be shown: its scheme and host, never its path (the secret
    of most incoming webhooks is there) nor its query."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "?", parts.port
    except ValueError:
        return "(unreadable URL)"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}{f':{port}' if port else ''}/…"


def address_problem(address: str) -> str | None:
    """None when `address` is one mail address (local@domain); else why not."""
    if len(address) > MAX_ADDRESS:
        return f"longer than {MAX_ADDRESS} characters"
    if not _ADDRESS.fullmatch(address):
        return "not one mail address (local@domain, nothing else)"
    return None


def env_name_problem(name: str) -> str | None:
    if not _ENV_NAME.fullmatch(name):
        return "not an environment variable's name (letters, digits and _, not a digit first)"
    return None


def glob_problem(glob: str) -> str | None:
    if not glob.strip() or len(glob) > 253 or not glob.isprintable():
        return "a job name or a glob (bert-*), printable, at most 253 characters"
    return None


# --------------------------------------------------------------------------- matching


def matches(rule: Rule, event: Stored) -> bool:
    """Whether the event is for this rule: its kind, whose work, which job."""
    e = event.event
    if rule.kinds and e.kind not in rule.kinds:
        return False
    if rule.owner and e.owner != rule.owner:
        return False
    return not rule.job or (bool(e.job) and fnmatch.fnmatchcase(e.job, rule.job))


# --------------------------------------------------------------------------- words


@dataclass(frozen=True)
class Message:
    title: str  # what happened, one line (the event's words)
    lines: tuple[str, ...]  # whose, how, where, the link, the event's id
    link: str | None  # its page on the dashboard (the service's --public-url), or None


_STUDY_KINDS = (Kind.STUDY_ENDED, Kind.STUDY_BEST)


def link(public_url: str | None, event: Stored) -> str | None:
    """The event's page on the dashboard: its job's (a study's for a study's events)."""
    e = event.event
    if not public_url or not e.job:
        return None
    page = "studies" if e.kind in _STUDY_KINDS else "jobs"
    return f"{public_url.rstrip('/')}/{page}/{quote(e.job, safe='')}"


def message(event: Stored, public_url: str | None = None) -> Message:
    e = event.event
    title = printable(e.words or f"{e.kind.value}: {e.job or e.host}")
    facts = []
    if e.owner:
        facts.append(f"owner {e.owner}")
    if e.how is not None:
        facts.append(f"how: {e.how.value}")
    if e.hosts or e.host:
        facts.append("on " + ", ".join(e.hosts or (e.host,)))
    if e.gpus:
        facts.append(f"{e.gpus} GPU{'s' if e.gpus != 1 else ''}")
    lines = [printable(" · ".join(facts))] if facts else []
    page = link(public_url, event)
    if page:
        lines.append(page)
    lines.append(f"event {event.id} ({e.kind.value}) at {event.to_json()['time']}")
    return Message(title, tuple(lines), page)


def _unpinged(text: str) -> str:
    """Chat text that cannot ping: Slack's escapes (& < >: no <!channel>, no <url|link>),
    and a zero-width space after an @ that starts a word (@channel, @all in Mattermost)."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _PING.sub("\\1@\u200b", text)


def chat_body(event: Stored, public_url: str | None) -> bytes:
    """Slack's incoming-webhook body, which Mattermost and others take too."""
    m = message(event, public_url)
    text = "\n".join([_unpinged(m.title), *(_unpinged(x) for x in m.lines)])
    return json.dumps({"text": text}, ensure_ascii=False).encode()


def webhook_body(event: Stored, rule: Rule, public_url: str | None, test: bool = False) -> bytes:
    """The generic webhook's body: the event as `provision events --json` prints it, its
    words and link."""
    m = message(event, public_url)
    doc = {
        "format_version": NOTIFY_FORMAT,
        "rule": rule.id,
        "test": test,
        "event": event.to_json(),
        "title": m.title,
        "text": "\n".join(m.lines),
        "link": m.link,
    }
    return json.dumps(doc, sort_keys=True, ensure_ascii=False).encode()


def signature(key: bytes, body: bytes) -> str:
    """The signature header's value: `sha256=` and the HMAC-SHA256 of the body, in hex."""
    return "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()


def headers(event: Stored, rule: Rule, body: bytes, key: bytes | None, version: str) -> dict[str, str]:
    out = {
        "Content-Type": "application/json; charset=utf-8",
        "User-Agent": f"provision/{version}",
        EVENT_HEADER: str(event.id),
        RULE_HEADER: rule.id,
    }
    if key is not None:
        out[SIGNATURE_HEADER] = signature(key, body)
    return out


def mail(event: Stored, rule: Rule, relay: Relay, public_url: str | None, domain: str) -> EmailMessage:
    """One event as a mail: the words as its subject; its Message-ID names the event and the
    rule, so a repeat is the same message to a mail client (and its X-Provision-Event)."""
    m = message(event, public_url)
    msg = EmailMessage()
    msg["From"] = relay.sender
    msg["To"] = rule.target
    subject = f"[provision] {m.title}"
    msg["Subject"] = subject if len(subject) <= MAX_SUBJECT else subject[: MAX_SUBJECT - 1] + "…"
    msg["Date"] = formatdate(event.time, usegmt=True)
    msg["Message-ID"] = f"<provision.{event.id}.{rule.id}@{domain}>"
    msg[EVENT_HEADER] = str(event.id)
    msg[RULE_HEADER] = rule.id
    msg.set_content("\n".join([m.title, "", *m.lines]) + "\n")
    return msg
