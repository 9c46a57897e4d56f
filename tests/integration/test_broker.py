"""The embedded broker and `ddpbus broker`, as real processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs import PublisherHooks, children, running, wait_for

from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, BrokerError, EmbeddedBroker
from ddpbus.orchestrator.transport.bus import BusUnavailable, connect

CLI = [sys.executable, "-m", "ddpbus.orchestrator.tools.cli"]


def test_port_zero_picks_a_free_port_and_reads_it_back(tmp_path: Path) -> None:
    with EmbeddedBroker(BrokerConfig(store_dir=tmp_path / "a")) as a, \
         EmbeddedBroker(BrokerConfig(store_dir=tmp_path / "b")) as b:
        assert a.port not in (0, 4222)
        assert a.port != b.port
        assert a.url == f"nats://127.0.0.1:{a.port}"


async def test_jetstream_is_on_and_the_store_survives_a_restart(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with EmbeddedBroker(BrokerConfig(store_dir=store)) as b:
        nc = await connect(b.url, name="t")
        js = nc.jetstream()
        await js.add_stream(name="KEEP", subjects=["keep.>"])
        await js.publish("keep.one", b"payload")
        assert nc.max_payload == 8 * 1024 * 1024
        await nc.close()
    with EmbeddedBroker(BrokerConfig(store_dir=store)) as b:
        nc = await connect(b.url, name="t")
        msg = await nc.jetstream().get_msg("KEEP", 1)
        assert msg.data == b"payload"
        await nc.close()


def test_a_bad_server_config_fails_loudly(tmp_path: Path) -> None:
    bad = tmp_path / "bad.conf"
    bad.write_text("this is { not valid\n")
    broker = EmbeddedBroker(BrokerConfig(config_file=bad, store_dir=tmp_path / "s"))
    with pytest.raises(BrokerError, match="exited"):
        broker.start()
    assert broker.process is None


def test_user_config_is_included(tmp_path: Path) -> None:
    conf = tmp_path / "extra.conf"
    conf.write_text("max_connections: 7\n")
    with EmbeddedBroker(BrokerConfig(config_file=conf, store_dir=tmp_path / "s",
                                     monitor_port=0)) as b:
        import json
        import urllib.request
        with urllib.request.urlopen(b.monitor_url + "/varz", timeout=5) as r:  # noqa: S310
            varz = json.load(r)
        assert varz["max_connections"] == 7
        assert varz["max_payload"] == 8 * 1024 * 1024


@pytest.mark.parametrize(("kwargs", "text"), [
    ({"port": 70000}, "port"), ({"max_payload": 10}, "max_payload"),
    ({"config_file": Path("/nonexistent.conf")}, "does not exist"),
])
def test_bad_broker_settings_are_refused(kwargs: dict[str, object], text: str) -> None:
    from ddpbus.codecs.errors import ConfigError
    with pytest.raises(ConfigError, match=text):
        BrokerConfig(**kwargs)  # type: ignore[arg-type]


async def test_connect_to_nothing_fails_within_its_deadline() -> None:
    from datetime import timedelta
    with pytest.raises(BusUnavailable):
        await connect("nats://127.0.0.1:1", name="t", deadline=timedelta(seconds=0.5))


@contextlib.contextmanager
def _cli_broker(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``ddpbus broker`` on a free port, its URL read back; killed at the end if alive."""
    proc = subprocess.Popen([*CLI, "broker", "--port", "0", "--store", str(tmp_path / "st")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("nats://127.0.0.1:"), proc.stderr.read() if proc.stderr else ""
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_broker_prints_url_serves_and_stops_cleanly(tmp_path: Path, sig: int) -> None:
    with _cli_broker(tmp_path) as (proc, url):
        async def ping() -> None:
            nc = await connect(url, name="t")
            await nc.jetstream().account_info()
            await nc.close()
        asyncio.run(ping())
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=20) == 0
        assert (tmp_path / "st" / "jetstream").is_dir()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_cli_broker_takes_its_server_along(tmp_path: Path) -> None:
    """SIGKILL runs no cleanup: the server gets SIGTERM from the kernel instead, and
    stops as it would at ``broker.stop()`` (store flushed), rather than live on."""
    with _cli_broker(tmp_path) as (proc, _):
        (server,) = children(proc.pid)
        assert running(server)
        proc.kill()
        proc.wait(timeout=20)
        wait_for("the orphaned nats-server to exit", lambda: not running(server), 20)
        assert "Server Exiting" in (tmp_path / "st" / "nats-server.log").read_text()


@pytest.mark.parametrize(("argv", "env", "text"), [
    (["broker", "--port", "70000"], {}, "is not a port"),
    (["broker", "--bogus"], {}, "unrecognized arguments"),
    (["broker"], {"DDPBUS_NO_SUCH": "1"}, "unknown environment variable"),
    (["broker"], {"DDPBUS_BROKER_PORT": "x"}, "DDPBUS_BROKER_PORT"),
    (["init-job", "--job", "bad job"], {}, "job name"),
    (["init-job", "--job", "j"], {}, "init-job needs --world-size"),  # --nats has a default
])
def test_cli_refuses_bad_flags_and_env(argv: list[str], env: dict[str, str], text: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DDPBUS_")}
    out = subprocess.run([*CLI, *argv], capture_output=True, text=True, env={**clean, **env},
                         timeout=60, check=False)
    assert out.returncode == 2
    assert text in out.stderr


@pytest.mark.parametrize("kill", [False, True])
async def test_publishing_through_a_broker_restart_loses_and_reorders_nothing(
        tmp_path: Path, kill: bool) -> None:
    """A publisher keeps submitting while the broker stops (SIGTERM, or SIGKILL) and comes
    back on the same port and store: every message is stored exactly once, in order."""
    from ddpbus.codecs import Decoder, Encoder
    from ddpbus.codecs import messages as m
    from ddpbus.orchestrator.transport.bus import Publisher

    store, key, n = tmp_path / "store", b"k" * 32, 3000
    first = EmbeddedBroker(BrokerConfig(store_dir=store))
    first.start()
    port = first.port
    hooks = PublisherHooks()
    nc = await hooks.connect(first.url, "restart-publisher")
    js = nc.jetstream()
    await js.add_stream(name="R", subjects=["ddpbus.r.>"], duplicate_window=120.0)
    publisher = hooks.publisher = Publisher(js)
    task = asyncio.create_task(publisher.run())
    encoder = Encoder(job="r", key=key, sender="coordinator", generation=1)
    second = EmbeddedBroker(BrokerConfig(port=port, store_dir=store))

    def restart() -> None:
        if kill and first.process is not None:
            first.process.kill()
        first.stop()
        second.start()

    try:
        restarting = None
        for i in range(n):
            publisher.submit(encoder.encode("ddpbus.r.control.all",
                                            m.SetGlobalStep(global_step=i)))
            if i == n // 3:
                restarting = asyncio.create_task(asyncio.to_thread(restart))
            await asyncio.sleep(0)
        assert restarting is not None
        await restarting
        assert await publisher.flush(60.0), publisher.failed
        decoder = Decoder(job="r", key=key)
        state = (await js.stream_info("R")).state
        steps = []
        for seq in range(state.first_seq, state.last_seq + 1):
            raw = await js.get_msg("R", seq)
            steps.append(decoder.decode(raw.subject, raw.headers, raw.data)
                         .message.global_step)  # type: ignore[union-attr]
        assert steps == list(range(n)), (
            f"{state.messages} stored; missing {sorted(set(range(n)) - set(steps))[:20]}; "
            f"first out of order at {next((i for i, s in enumerate(steps) if s != i), None)}")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await nc.close()
        second.stop()
        first.stop()
