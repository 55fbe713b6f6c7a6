"""Runs verifiers v1 environments (`verifiers.v1`: taskset + harness + runtime) as Atropos environment processes."""
