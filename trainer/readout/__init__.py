"""Reading finished or running run folders: `python -m trainer summary` and `python -m trainer report`."""
