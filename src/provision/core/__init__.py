"""The bottom layer above host/: frozen types, the env encoding, task lifecycle rules and the
words that explain an ending. Imports nothing of provision but host/'s shared vocabulary."""
