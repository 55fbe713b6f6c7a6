"""The gateway's HTTP layer, below app.py: the body guard that bounds and parses every request (guard, stepjson),
turning bodies into validated requests (intake), counting refusals (accounting), and the named-adapter routes.
It may import the samplers, the policy layer and the bottom modules (wire, config, errors, polling); nothing below
imports it."""
