"""click commands only: parse arguments, call run/, print, choose the exit code."""
