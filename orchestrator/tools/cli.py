"""The ``ddpbus`` command line.

Settings come from flags, then ``DDPBUS_*`` environment variables, then defaults (the NATS
URL: ``--nats``, ``DDPBUS_NATS_URL``, then ``NATS_URL`` as natscli and nats.py read it, then
``nats://127.0.0.1:4222``); an unknown ``DDPBUS_*`` variable or a bad value is refused before
anything starts (exit 2, under the subcommand's usage), with the closest known name
suggested. ``--log-level`` (any case) goes before or after the subcommand.

Every failure ends in one line on stderr, never a traceback: a bad setting exits 2, a known
failure (no such job, NATS unreachable within ``--timeout``, a refused login) exits 1,
Ctrl-C exits 130 quietly, a closed pipe (``ddpbus sub | head``) exits 0 silently, and an
unexpected error says so in one line (``--log-level debug`` shows its traceback).

Kubernetes gives every pod service-link variables for each Service in its namespace
(``<NAME>_SERVICE_HOST``, ``<NAME>_PORT_9090_TCP``...), unless the pod sets
``enableServiceLinks: false``: a Service named ``ddpbus-...`` would name some ``DDPBUS_*``.
Those are ignored (:func:`service_link`), unless the name is one letter or two away from a
setting of ours: then it is a typo, and refused.
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
from importlib import metadata
from typing import Any

from ddpbus.codecs.errors import ConfigError, DdpbusError
from ddpbus.orchestrator.tools import commands

log = logging.getLogger("ddpbus.cli")

# flag dest -> environment variable, per subcommand
ENV_VARS: dict[str, dict[str, str]] = {c.NAME: c.ENV for c in commands.ALL}
GLOBAL_ENV = {"DDPBUS_LOG_LEVEL"}
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_NATS = "nats://127.0.0.1:4222"  # natscli's and nats.py's default too
EXIT_INTERRUPTED = 130
# the modules the install extras bring (pyproject.toml): `pip install ddpbus` alone has the
# codecs and the operator tools (sub, status, replay, delete-job)
EXTRAS = {"torch": "train", "numpy": "train", "safetensors": "train",
          "prometheus_client": "train", "matplotlib": "report", "sklearn": "examples"}
# the processes of a job keep a crash's traceback (in the user's training code, often) for
# their logs; the operator tools say it in one line
TRACEBACKS = {"coordinator", "worker"}
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


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's own, but an epilog that starts "examples:" keeps its lines as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _examples(lines: Sequence[str]) -> str:
    return "examples:\n" + "".join(f"  {line}\n" for line in lines)


def _version() -> str:
    try:
        own = metadata.version("ddpbus")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        own = "unknown (not installed)"
    from ddpbus.codecs.subjects import SCHEMA_VERSION

    return f"ddpbus {own} (wire schema v{SCHEMA_VERSION}, Python {sys.version.split()[0]})"


def _log_level(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: a subcommand's parser must not reset what was given before the subcommand
    p.add_argument("--log-level", type=str.upper, choices=LEVELS, default=argparse.SUPPRESS,
                   metavar="LEVEL", help="debug, info, warning or error, any case; before or "
                   "after the subcommand (env DDPBUS_LOG_LEVEL; default info, warning for "
                   "`run`)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpbus", description="Data-parallel PyTorch training orchestrated over NATS.",
        formatter_class=_HelpFormatter, epilog=_examples([
            "ddpbus run examples/digits.py:spec --workers 2   # train on this machine",
            "ddpbus status --job digits --key-file job.key     # where a job stands",
            "ddpbus sub --job digits --key-file job.key        # its traffic, decoded",
            "ddpbus COMMAND --help                              # each command's examples"]))
    parser.add_argument("--version", action="version", version=_version())
    _log_level(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in commands.ALL:
        p = command.add_parser(sub)
        _log_level(p)
        p.formatter_class = _HelpFormatter
        p.epilog = _examples(command.EXAMPLES)
    return parser


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of one subcommand (whose usage a bad setting of it is shown with)."""
    for action in parser._actions:  # argparse lists its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            chosen: argparse.ArgumentParser = action.choices[command]
            return chosen
    raise AssertionError("ddpbus's parser has no subcommands")


def _flags(parser: argparse.ArgumentParser, command: str) -> dict[str, argparse.Action]:
    """The flags (and positionals) of one subcommand, by destination."""
    return {a.dest: a for a in subparser(parser, command)._actions}


def _from_env(flag: argparse.Action, text: str) -> Any:
    """A variable's value, converted and checked exactly as its flag's would be."""
    value = flag.type(text) if callable(flag.type) else text
    if flag.choices is not None and value not in flag.choices:
        raise ValueError(f"not one of {', '.join(map(str, flag.choices))}")
    return value


def merge_env(parser: argparse.ArgumentParser, args: argparse.Namespace,
              environ: Mapping[str, str]) -> argparse.Namespace:
    """Fill unset flags from ``DDPBUS_*`` variables (and the NATS URL from ``NATS_URL``, then
    the default); refuse unknown ones, under the subcommand's usage."""
    parser = subparser(parser, args.command)
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
    if getattr(args, "log_level", None) is None:
        # `ddpbus run` shows its own progress and table; its processes log to files
        quiet = "WARNING" if args.command == "run" else "INFO"
        args.log_level = environ.get("DDPBUS_LOG_LEVEL", quiet).upper()
        if args.log_level not in LEVELS:
            parser.error(f"DDPBUS_LOG_LEVEL={environ['DDPBUS_LOG_LEVEL']!r}: not one of "
                         f"{', '.join(LEVELS)} (any case)")
    flags = {a.dest: a for a in parser._actions}
    for dest, var in ENV_VARS.get(args.command, {}).items():
        if getattr(args, dest, None) is None and var in environ:
            try:
                setattr(args, dest, _from_env(flags[dest], environ[var]))
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{var}={environ[var]!r}: {exc}")
    if "nats" in flags and getattr(args, "nats", None) is None:
        args.nats = environ.get("NATS_URL") or DEFAULT_NATS
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
        if (extra := _missing_extra(exc)) is not None:  # a spec that imports torch, say
            return _failed(args.command, extra)
        subparser(parser, args.command).error(str(exc))
    except DdpbusError as exc:
        return _failed(args.command, str(exc))
    except ModuleNotFoundError as exc:
        if (extra := _missing_extra(exc)) is None:  # not ours: the user's, with its traceback
            raise
        return _failed(args.command, extra)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # past the ^C the terminal echoed
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `ddpbus sub | head`: the reader has all it wanted; the exit status says nothing
        # went wrong, and the flush at exit must not complain about the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        if args.command in TRACEBACKS:
            raise
        log.debug("the traceback", exc_info=True)
        return _failed(args.command, f"unexpected {type(exc).__name__}: {exc} (a bug in "
                       "ddpbus, or a failure it does not yet explain; rerun with --log-level "
                       "debug for the traceback)")


def _missing_extra(exc: BaseException | None) -> str | None:
    """What to install, where ``exc`` (or what caused it) is an extra's missing module."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError):
            top = (exc.name or "").partition(".")[0]
            if top in EXTRAS:
                return (f"needs {top}, which this install lacks: pip install "
                        f"'ddpbus[{EXTRAS[top]}]'")
        exc = exc.__cause__
    return None


def _failed(command: str, why: str) -> int:
    print(f"ddpbus {command}: {' '.join(why.split())}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
