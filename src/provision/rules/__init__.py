"""Judging, without touching the network: the plan (desired vs. reported), job status,
tenancy (who holds what), pre-flight, the queue's order, preemption, admission, the events
between two rounds (pure functions, tested as tables)."""
