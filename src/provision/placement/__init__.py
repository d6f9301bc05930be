"""Where every task runs: a pure function of the model (core/model.py), deterministic, so
the same inventory always gives every task the same host, port and accelerators. Below
inventory/, whose check asks it whether the job fits."""
