"""``ddpbus report``: a recorded run's HTML report with PNG plots."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from ddpbus.orchestrator.tools import flags
from ddpbus.orchestrator.transport.auth import OBSERVER

NAME = "report"
ENV = flags.READER_ENV

# shown under the subcommand's --help
EXAMPLES = (
    'ddpbus report --job digits --key-file job.key --out report/   # report/index.html',
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        NAME, help="a recorded run's HTML report with plots",
        description="Build a job's run report from its stream: an HTML page with PNG plots "
        "(loss and eval per epoch, per-rank throughput, batch share, anchor and averaging "
        "interval, divergence, membership events).")
    flags.reader(p)
    p.add_argument("--out", type=Path, help="directory for index.html and the plots "
                   "(default ./ddpbus-report-<job>)")
    return p


def run(args: argparse.Namespace) -> int:
    from ddpbus.orchestrator.runtime import html_report  # matplotlib: only when asked for
    from ddpbus.orchestrator.tools.progress import progress_bar

    key = flags.reader_key(args, NAME)
    out = args.out or Path(f"ddpbus-report-{args.job}")
    bar, advance = progress_bar("reading the stream")
    if bar is not None:
        bar.start()
    try:
        index = asyncio.run(html_report.build(flags.nats_access(args, OBSERVER), args.job, key,
                                              out, advance))
    finally:
        if bar is not None:
            bar.stop()
    print(index)
    return 0
