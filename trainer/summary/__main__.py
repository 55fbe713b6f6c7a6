"""`python -m trainer.summary FOLDER ...`: a run folder or a service client's folder, summarised as JSON."""

from __future__ import annotations

import sys

from trainer.orchestration.summary import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
