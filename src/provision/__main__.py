"""`python -m provision` runs the CLI."""

from provision.cli.app import main

main(prog_name="provision")
