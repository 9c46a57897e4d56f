"""The coordinator's system-account login (fast death detection): exactly one of an nkey
seed, a .creds file or a user with a password file; a half-given or doubled login is a
clear error before anything connects."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from ddpbus.codecs import subjects as sj
from ddpbus.codecs.errors import ConfigError
from ddpbus.orchestrator.tools import flags
from ddpbus.orchestrator.transport import auth


def args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(nats="nats://n:4222", **kw)


def test_no_system_login_is_none() -> None:
    assert flags.system_access(args()) is None


def test_each_kind_of_login_is_taken(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_text("x")
    seed = tmp_path / "system.nk"
    auth.ensure_seed(seed)
    for kw in ({"nats_system_nkey": seed}, {"nats_system_creds": f},
               {"nats_system_user": "system", "nats_system_password_file": f}):
        access = flags.system_access(args(**kw))
        assert access is not None
        assert access.identity == sj.SYSTEM
        assert access.url == "nats://n:4222"
    access = flags.system_access(args(nats_system_user="system", nats_system_password_file=f))
    assert access is not None
    assert access.auth is not None
    assert (access.auth.user, access.auth.password_file) == ("system", f)


@pytest.mark.parametrize(("kw", "message"), [
    ({"nats_system_nkey": "F", "nats_system_creds": "F"},
     "choose one system-account login, not --nats-system-nkey and --nats-system-creds"),
    ({"nats_system_nkey": "F", "nats_system_user": "u", "nats_system_password_file": "F"},
     "not --nats-system-nkey and --nats-system-user"),
    ({"nats_system_user": "u"}, "--nats-system-user needs --nats-system-password-file"),
    ({"nats_system_password_file": "F"}, "needs --nats-system-password-file, and the "),
    ({"nats_system_user": "u", "nats_system_password_file": "MISSING"},
     "password file .* does not exist"),
])
def test_a_bad_login_is_refused(tmp_path: Path, kw: dict[str, str], message: str) -> None:
    f = tmp_path / "secret"
    f.write_text("x")
    given = {k: (tmp_path / "missing" if v == "MISSING" else f if v == "F" else v)
             for k, v in kw.items()}
    with pytest.raises(ConfigError, match=message):
        flags.system_access(args(**given))
