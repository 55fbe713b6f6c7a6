"""The gateway's HTTP layer, below app.py: the body guard that bounds and parses every request (body_guard, incremental_json),
turning bodies into validated requests (intake), counting refusals (accounting), the routes of named adapters, engines, evaluation, the trainer and token-in clients.
It may import the samplers, the policy layer and the bottom modules (wire, config, errors, polling); nothing below
imports it."""
