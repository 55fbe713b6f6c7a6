"""Which adapter serves what, without I/O towards clients: the policy versions and the ledger of which version
produced a completion (registry), the on-policy gate (gate), the checks an adapter folder passes before vLLM sees
it (adapters), and publish verification's comparison (probe_check). It imports only the bottom modules (wire,
config, errors, polling)."""
