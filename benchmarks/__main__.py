"""`python -m benchmarks NAME [...]`: measure the project from outside, one JSON object per run.

python -m benchmarks trainer [--shape llama-3.1-8b --device cuda]   # trainer tokens/s, MFU, memory, save time
python -m benchmarks gateway [...]                                  # publish latency, cold restart, overhead
python -m benchmarks service [...]                                  # Tinker-protocol service, 1/2/4 clients
python -m benchmarks onpolicy [...]                                 # toy loop by staleness bound x gate
python -m benchmarks soak --minutes 30 --fault-every 60             # the toy loop under faults
python -m benchmarks distill [--teacher RUN_DIR]                    # distillation against RL from scratch (toy)
python -m benchmarks engine [--pairs 3]                             # time to first step: own vLLM vs attached
python -m benchmarks client_pool [--concurrency 64 128]             # the gateway's client to vLLM: CPU a request

`python -m benchmarks NAME --help` gives each one's options; `python -m benchmarks.MODULE` runs the same code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {  # name -> (module whose main(argv) it runs, one line for --help)
    "trainer": ("benchmarks.trainer_bench", "trainer throughput: LoRA forward+backward+AdamW tokens/s"),
    "gateway": ("benchmarks.gateway_bench", "gateway: publish latency against a vLLM cold restart, overhead"),
    "service": ("benchmarks.service_bench", "Tinker-protocol service under 1, 2 and 4 SDK clients"),
    "onpolicy": ("benchmarks.onpolicy_bench", "toy loop at several staleness bounds, gate on and off"),
    "soak": ("benchmarks.soak", "toy loop under a fault every M seconds for N minutes"),
    "engine": ("benchmarks.engine_bench", "time to a run's first step: its own vLLM against a shared engine"),
    "client_pool": (
        "benchmarks.client_pool_bench",
        "the gateway's HTTP client to vLLM: httpx against httpx2",
    ),
    "distill": (
        "benchmarks.distill_bench",
        "toy: a student distilled from a teacher against RL from scratch",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="NAME")
    for name, (_, summary) in COMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in and args_in[0] in COMMANDS:  # the rest of the line is the benchmark's own
        module = importlib.import_module(COMMANDS[args_in[0]][0])
        return int(module.main(args_in[1:]) or 0)
    build_parser().parse_args(args_in)  # --help, or an error naming the choices
    return 2


if __name__ == "__main__":
    sys.exit(main())
