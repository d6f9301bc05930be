"""`python -m provision` runs the CLI."""

from .cli import main

main(prog_name="provision")
