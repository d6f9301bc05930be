"""`provision sandbox up/down` (being written)."""

import click


@click.group()
def sandbox() -> None:
    """Local test hosts: Docker containers with systemd and sshd."""
