"""`python -m provision` runs the CLI."""

from provision.cli.app import run

run()
