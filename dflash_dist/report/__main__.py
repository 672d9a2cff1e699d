"""python -m dflash_dist.report RUN_DIR [RUN_DIR ...] [--out DIR] [--labels A,B]

Exit codes: 0 written; 2 a run directory or one of its files cannot be read (the message names it and
the line), the --out folder cannot be created or written, or matplotlib is not installed.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dflash_dist.io.files import OutputPathError
from dflash_dist.report import ReportInputError, make_report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dflash_dist.report",
                                 description="Figures and an HTML page from runs' metrics.jsonl and summary.json "
                                             "(no wandb needed). Several runs are overlaid on the same axes.")
    ap.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="a run's train.run_dir")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: RUN_DIR/report for one run, ./report for several)")
    ap.add_argument("--labels", default=None, help="comma-separated names for the runs (default: folder names)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    out = args.out or (args.run_dirs[0] / "report" if len(args.run_dirs) == 1 else Path("report"))
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    try:
        import matplotlib  # noqa: F401  (an optional extra: say how to get it rather than a traceback)
    except ImportError:
        print("error: the report draws with matplotlib, which is not installed: EXTRAS=report bash "
              "launch/setup.sh (or pip install -e '.[report]')", file=sys.stderr)
        return 2
    try:
        rep = make_report(args.run_dirs, out, labels)
    except (ReportInputError, OutputPathError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {rep.index} with {len(rep.figures)} figures:")
    for p in rep.figures:
        print(f"  {p}")
    for name, why in rep.left_out.items():
        print(f"  left out {name}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
