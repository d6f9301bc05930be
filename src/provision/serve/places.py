"""Which service database a state backend's work goes to: a local state's to the embedded
SQLite file, a PostgreSQL state's to that database (its own tables)."""

from __future__ import annotations

from pathlib import Path

from provision.inventory.statebackend import Backend
from provision.io.servicedb import default_db
from provision.io.servicelead import Leadership
from provision.io.servicestore import ServiceStore


def open_place(place: str, db: Path | None = None) -> ServiceStore:
    """place: "local" (the embedded file, db or the default) or a postgresql:// URL."""
    if place == "local":
        return ServiceStore.open_local(db or default_db())
    return ServiceStore.open_pg(place, Backend(place).place)


def open_backend(backend: Backend) -> ServiceStore:
    return open_place(backend.url)


def leadership(store: ServiceStore, url: str) -> Leadership:
    if store.path is not None:
        return Leadership(lock_file=store.path.with_name(store.path.name + ".leader"))
    return Leadership(pg_url=url)


def work_root(store: ServiceStore) -> Path:
    """Where the service materialises submissions: beside the embedded database (a team's
    service uses the embedded file's directory on its own machine)."""
    base = store.path.parent if store.path is not None else default_db().parent
    return base / "work"
