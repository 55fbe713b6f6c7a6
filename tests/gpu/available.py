"""`python -m tests.gpu.available`: exit 0 when torch sees a CUDA GPU (tests/run.sh then runs the GPU tier), else
say why not on stderr and exit 1."""

from __future__ import annotations

import sys


def why_not() -> str | None:
    """None where the GPU tier can run; else the reason it cannot."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    return None


def main() -> int:
    reason = why_not()
    if reason is not None:
        print(f"[tests] GPU tier skipped: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
