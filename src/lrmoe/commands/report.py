"""``lrmoe report RUN_DIR``: plot a run's metrics into PNGs in the run directory."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("report", help="plot a run's loss and expert load into PNGs",
                       description="Write loss.png, expert_load.png, load_balance.png (and "
                                   "rank_load.png for EP runs) into RUN_DIR.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lrmoe.report import write_report

    for path in write_report(args.run_dir):
        print(path)
    return 0
