"""python -m trainer export RUN_DIR --out DIR [--version N | --step N] [--merge [--dtype D]] [--push REPO_ID]

Writes the run's newest published policy (or the one asked for) as a PEFT adapter folder, or with --merge as a
full Hugging Face model folder (merged weights, tokenizer, chat template, generation config), each with a README.md
model card; --push uploads that folder to a hub repository (private unless --public)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.export.origin import ExportError, ExportSource
from trainer.export.source import find_source


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "source", type=Path, help="a run folder, one of its checkpoints, or its adapters/vN folder"
    )
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (new, or empty)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, help="a published policy version (default: the newest)")
    which.add_argument("--step", type=int, help="the version this optimizer step published")
    parser.add_argument("--merge", action="store_true", help="merge the adapter into the base's weights")
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="dtype of the merged weights (auto: the base's)",
    )
    parser.add_argument("--push", metavar="REPO_ID", help="upload the exported folder to this hub repository")
    visibility = parser.add_mutually_exclusive_group()
    visibility.add_argument(
        "--private", dest="public", action="store_false", help="a new repo is private (default)"
    )
    visibility.add_argument("--public", dest="public", action="store_true", help="a new repo is public")
    parser.set_defaults(public=False)  # else --private's store_false would make True the default
    return parser


def export(src: ExportSource, out: Path, merge: bool, dtype: str) -> Path:
    """Write the export of `src` into `out` (complete, or not there at all)."""
    from trainer.export.card import base_licence, model_card
    from trainer.export.weights import (
        base_dtype,
        check_disk,
        merged_bytes,
        staged,
        write_adapter,
        write_merged,
    )
    from trainer.orchestration.commands import git_sha
    from trainer.readout.runfolder import read_eval, read_metrics

    dtype = base_dtype(src.base.folder) if dtype == "auto" else dtype
    if merge:
        check_disk(out, merged_bytes(src.base.folder, dtype))
    evals: list[dict] = []
    if src.run_dir is not None:
        evals, _ = read_eval(src.run_dir, read_metrics(src.run_dir / "metrics.jsonl").rows)
    readme = src.base.folder / "README.md"
    licence = base_licence(readme.read_text(errors="replace") if readme.is_file() else None)
    with staged(out) as tmp:
        facts = write_merged(src, tmp, dtype) if merge else None
        if not merge:
            write_adapter(src, tmp)
        (tmp / "README.md").write_text(model_card(src, merge, evals, licence, git_sha(), facts))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        src = find_source(args.source, args.version, args.step)
        print(f"export: {src.label} of {src.run_dir or src.adapter}, base {src.base.name}", flush=True)
        out = export(src, args.out, args.merge, args.dtype)
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        kind = "merged model" if args.merge else "PEFT adapter"
        print(f"export: {kind} in {out} ({size / 1e6:.1f} MB)", flush=True)
        if args.push:
            from trainer.export.hub import push

            url = push(out, args.push, not args.public, f"Export of {src.label}")
            print(f"export: pushed to {args.push} ({url})", flush=True)
        with_config = f" --config {src.run_dir / 'config.yaml'}" if src.run_dir else ""
        print(f"talk to it: python -m trainer serve {out}{with_config}", flush=True)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
