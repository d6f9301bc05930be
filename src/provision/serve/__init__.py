"""`provision serve`: the service that does the team's work without a terminal (issue 40)."""
