"""`python -m trainer.summary FOLDER ...`: the same as `python -m trainer summary` (trainer/orchestration/summary.py)."""
