"""Who is told what: a rule picks events of the stream (core/events.py) by kind, by whose
work and by job name, and names where they go (a chat service's incoming webhook, a signed
JSON webhook, or an address mailed through the team's SMTP relay). Kept in the service's
database (io/servicenotify.py), delivered by the leading service (serve/notify.py), put
into words by rules/notify.py.

A webhook's URL is a secret (whoever has it may post): a rule's `target` is left out of its
repr, and every printer shows rules/notify.masked(url). Signing keys and the relay's
password are never here: only the NAMES of the service's environment variables that hold
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from provision.core.events import Kind

NOTIFY_FORMAT = 1  # `notify list --json`, and the webhook's body


class Channel(StrEnum):
    SLACK = "slack"  # {"text": ...}: Slack's incoming webhook (Mattermost and others take it)
    WEBHOOK = "webhook"  # the event as JSON, signed with HMAC-SHA256 when a key is named
    EMAIL = "email"  # a message through the relay (Relay)


@dataclass(frozen=True)
class Rule:
    id: str
    channel: Channel
    target: str = field(repr=False)  # the URL (a secret) or the address
    owner: str = ""  # only this owner's work; "": everyone's
    job: str = ""  # only jobs whose name matches this glob; "": every job
    kinds: tuple[Kind, ...] = ()  # (): every kind
    secret_env: str = ""  # a webhook's: the service's variable that holds its signing key
    created: float = 0.0
    created_by: str = ""

    @property
    def cursor(self) -> str:
        """The name of its cursor in the event stream (io/serviceevents.py)."""
        return f"notify:{self.id}"


@dataclass(frozen=True)
class Relay:
    """The team's SMTP relay, set once (`provision notify smtp`): never its password, only
    the service's variable that holds it."""

    host: str
    port: int
    sender: str  # the From: address
    user: str = ""  # "": no login (a relay that trusts its network)
    password_env: str = ""
