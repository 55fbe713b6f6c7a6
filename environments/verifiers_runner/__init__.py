"""The runner for verifiers environments (`bash launch.sh vf:ENV`): see environments/verifiers_runner/env.py."""
