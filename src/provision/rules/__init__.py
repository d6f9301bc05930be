"""Judging what hosts report against the spec, without touching the network: the plan
(desired vs. reported), job status, tenancy (who holds what), facts, programs, pre-flight."""
