"""``DDPBUS_*`` variables arrive as the types their flags have."""

from __future__ import annotations

from pathlib import Path

from ddpbus.orchestrator.cli import build_parser, merge_env


def test_path_variables_become_paths() -> None:
    parser = build_parser()
    args = parser.parse_args(["worker"])
    env = {"DDPBUS_BUNDLE_DIR": "/vol/bundles", "DDPBUS_OUT": "/vol/out",
           "DDPBUS_RANK": "3", "DDPBUS_RESUME": "x"}
    args = merge_env(parser, args, {k: v for k, v in env.items() if k != "DDPBUS_RESUME"})
    assert args.bundle_dir == Path("/vol/bundles")
    assert args.out == Path("/vol/out")
    assert args.rank == 3
    coord = merge_env(parser, parser.parse_args(["coordinator"]), {"DDPBUS_RESUME": "old-job"})
    assert coord.resume == "old-job"
