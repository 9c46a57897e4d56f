"""The ``ddpbus`` command line.

Settings come from flags, then ``DDPBUS_*`` environment variables, then defaults; an
unknown ``DDPBUS_*`` variable or a bad value is refused before anything starts (exit 2),
with the closest known name suggested. Kubernetes gives every pod service-link variables
for each Service in its namespace (``<NAME>_SERVICE_HOST``, ``<NAME>_PORT_9090_TCP``...),
unless the pod sets ``enableServiceLinks: false``: a Service named ``ddpbus-...`` would
name some ``DDPBUS_*``. Those are ignored (:func:`service_link`), unless the name is one
letter or two away from a setting of ours: then it is a typo, and refused.
This is the only module that reads ``os.environ``.
"""

from __future__ import annotations

import argparse
import difflib
import faulthandler
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ddpbus.codecs.errors import ConfigError, DdpbusError
from ddpbus.orchestrator.tools import commands

log = logging.getLogger("ddpbus.cli")

# flag dest -> environment variable, per subcommand
ENV_VARS: dict[str, dict[str, str]] = {c.NAME: c.ENV for c in commands.ALL}
GLOBAL_ENV = {"DDPBUS_LOG_LEVEL"}
RUNNERS: dict[str, Callable[[argparse.Namespace], int]] = {c.NAME: c.run for c in commands.ALL}
# the variables Kubernetes derives from a Service's name (upper case, "-" as "_"):
# NAME_SERVICE_HOST, NAME_SERVICE_PORT[_PORTNAME], NAME_PORT, NAME_PORT_<n>_<PROTO>[_PROTO|
# _PORT|_ADDR] (kubernetes/pkg/kubelet/envvars)
SERVICE_LINK = re.compile(r"[A-Z0-9_]+_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT"
                          r"|PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)")
SERVICE_LINK_VALUE = re.compile(r"(tcp|udp|sctp)://[^\s/]+:\d+")  # NAME_PORT's value


def edits(a: str, b: str) -> int:
    """Edits (insert, delete, substitute, swap two neighbours) from ``a`` to ``b``."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            cost = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, prev2[j - 2] + 1)
            row.append(cost)
        prev2, prev = prev, row
    return prev[-1]


def service_link(name: str, known: set[str]) -> bool:
    """A variable shaped like a Kubernetes service link and not a typo of a setting (one
    edit away from one: DDPBUS_METRIC_PORT is a typo, DDPBUS_PORT a Service "ddpbus")."""
    return (SERVICE_LINK.fullmatch(name) is not None
            and all(edits(name, k) > 1 for k in known))


def _unknown(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"{name} (did you mean {close[0]}?)" if close else name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpbus", description="Data-parallel PyTorch training orchestrated over NATS.")
    parser.add_argument("--log-level", default=None,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level (env DDPBUS_LOG_LEVEL; default INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in commands.ALL:
        command.add_parser(sub)
    return parser


def _flags(parser: argparse.ArgumentParser, command: str) -> dict[str, argparse.Action]:
    """The flags (and positionals) of one subcommand, by destination."""
    for action in parser._actions:  # argparse lists its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a for a in action.choices[command]._actions}
    raise AssertionError("ddpbus's parser has no subcommands")


def _from_env(flag: argparse.Action, text: str) -> Any:
    """A variable's value, converted and checked exactly as its flag's would be."""
    value = flag.type(text) if callable(flag.type) else text
    if flag.choices is not None and value not in flag.choices:
        raise ValueError(f"not one of {', '.join(map(str, flag.choices))}")
    return value


def merge_env(parser: argparse.ArgumentParser, args: argparse.Namespace,
              environ: Mapping[str, str]) -> argparse.Namespace:
    """Fill unset flags from ``DDPBUS_*`` variables; refuse unknown ones."""
    known = GLOBAL_ENV | {v for table in ENV_VARS.values() for v in table.values()}
    unknown = sorted(k for k in environ if k.startswith("DDPBUS_") and k not in known
                     and not service_link(k, known))
    if unknown:
        named = ", ".join(_unknown(k, known) for k in unknown)
        parser.error(f"unknown environment variable(s) {named}; "
                     f"known: {', '.join(sorted(known))}")
    # a setting's own name given a service link's value: a Service named after it (one
    # called "ddpbus-metrics" sets DDPBUS_METRICS_PORT=tcp://10.0.0.7:9090); not ours
    linked = sorted(k for k in known & environ.keys()
                    if SERVICE_LINK_VALUE.fullmatch(environ[k]) and SERVICE_LINK.fullmatch(k))
    if linked:
        print(f"ddpbus: ignoring {', '.join(linked)}: Kubernetes service links (a Service "
              "named like the setting; set enableServiceLinks: false on the pod)",
              file=sys.stderr)
        environ = {k: v for k, v in environ.items() if k not in linked}
    if args.log_level is None:
        # `ddpbus run` shows its own progress and table; its processes log to files
        quiet = "WARNING" if args.command == "run" else "INFO"
        args.log_level = environ.get("DDPBUS_LOG_LEVEL", quiet).upper()
        levels = next(a.choices for a in parser._actions if a.dest == "log_level")
        if levels is not None and args.log_level not in levels:
            parser.error(f"DDPBUS_LOG_LEVEL={environ['DDPBUS_LOG_LEVEL']!r}: not one of "
                         f"{', '.join(levels)}")
    flags = _flags(parser, args.command)
    for dest, var in ENV_VARS.get(args.command, {}).items():
        if getattr(args, dest, None) is None and var in environ:
            try:
                setattr(args, dest, _from_env(flags[dest], environ[var]))
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{var}={environ[var]!r}: {exc}")
    return args


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = build_parser()
    args = merge_env(parser, parser.parse_args(argv), os.environ if environ is None else environ)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # `kill -USR1 <pid>` prints every thread's stack to stderr: a hung process explains itself
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        return RUNNERS[args.command](args)
    except ConfigError as exc:
        parser.error(str(exc))
    except DdpbusError as exc:
        log.error("%s", exc)  # noqa: TRY400 - a known failure, said in one line
        return 1


if __name__ == "__main__":
    sys.exit(main())
