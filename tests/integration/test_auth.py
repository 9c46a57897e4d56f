"""Per-identity credentials on a real nats-server started by `ddpbus broker --auth`: every
identity-subject pair of the matrix names is allowed or refused by the server itself (the
permission error is asserted), and so are the JetStream, KV and consumer calls a rank must
not make. TLS: a server with a certificate admits a client that trusts its CA, and only
that one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import nats
import nats.errors
import pytest
from jobs import delete_job
from nats.aio.client import Client

from ddpbus.codecs import subjects as sj
from ddpbus.orchestrator.runtime.provision import ensure_job
from ddpbus.orchestrator.tools import delete_job as teardown
from ddpbus.orchestrator.transport import auth
from ddpbus.orchestrator.transport.bus import BusUnavailable

pytestmark = pytest.mark.timeout(120)
JOB = "locked"
P = f"ddpbus.{JOB}"
STREAM = sj.stream_name(JOB)
WAIT_S = 10.0  # deadline of every wait for a delivery or a refusal


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`ddpbus broker --auth DIR --job locked --world-size 2`, as an operator runs it."""
    creds = tmp_path_factory.mktemp("auth") / "creds"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpbus.orchestrator.tools.cli", "broker", "--auth", str(creds),
         "--job", JOB, "--world-size", "2"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()  # printed once the server accepts connections
    try:
        assert url.startswith("nats://"), url
        yield url, creds
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


class Login:
    """One identity's connection, with the server's refusals as they arrive."""

    def __init__(self, nc: Client, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    async def refused(self, what: str, subject: str) -> None:
        """Wait until the server refuses ``what`` ("publish" or "subscription") to
        ``subject`` (nats-py lower-cases the error text)."""
        needle = f'permissions violation for {what} to "{subject.lower()}"'
        deadline = time.monotonic() + WAIT_S
        while not any(needle in e for e in self.errors):
            assert time.monotonic() < deadline, f"not refused: {what} {subject}: {self.errors}"
            await asyncio.sleep(0.01)  # poll interval of a deadline-bound wait


async def login(url: str, creds: Path, identity: str) -> Login:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    nc = await nats.connect(url, name=identity, error_cb=on_error,
                            nkeys_seed_str=auth.seed_path(creds, identity).read_text().strip(),
                            inbox_prefix=sj.inbox_prefix(JOB, identity),
                            max_reconnect_attempts=1, reconnect_time_wait=0.1)
    return Login(nc, errors)


IDENTITIES = ("coordinator", "observer", "rank-0", "rank-1")

# subject -> the identities that may publish on it (everyone else is refused)
PUBLISH = {
    f"{P}.control.rank.0": {"coordinator"},
    f"{P}.control.rank.1": {"coordinator"},
    f"{P}.control.all": {"coordinator"},
    f"{P}.admit.rank.1": {"coordinator"},
    f"{P}.live.coordinator": {"coordinator"},
    f"{P}.data.consensus": {"coordinator"},
    f"{P}.timing.rank.0": {"rank-0"},
    f"{P}.metrics.rank.0": {"rank-0"},
    f"{P}.join.rank.0": {"rank-0"},
    f"{P}.live.rank.0": {"rank-0"},
    f"{P}.data.rank.0": {"rank-0"},
    f"{P}.timing.rank.1": {"rank-1"},
    f"{P}.metrics.rank.1": {"rank-1"},
    f"{P}.live.rank.1": {"rank-1"},
    f"{P}.timing.all": set(),  # no such subject: nobody
    "ddpbus.other-job.control.all": set(),  # another job's: nobody
}

# subject -> the identities that may subscribe to it
SUBSCRIBE = {
    f"{P}.control.rank.0": {"observer", "rank-0"},
    f"{P}.control.rank.1": {"observer", "rank-1"},
    f"{P}.control.all": {"observer", "rank-0", "rank-1"},
    f"{P}.admit.rank.0": {"observer", "rank-0"},
    f"{P}.live.coordinator": {"observer", "rank-0", "rank-1", "coordinator"},  # live.>
    f"{P}.timing.rank.0": {"observer", "coordinator"},
    f"{P}.metrics.rank.1": {"observer", "coordinator"},
    f"{P}.live.rank.0": {"observer", "coordinator"},
    f"{P}.join.rank.1": {"observer", "coordinator"},
    "ddpbus.other-job.timing.rank.0": set(),
}


def sender_of(subject: str) -> str:
    """The identity that may publish on ``subject`` (to test a subscription)."""
    kind = subject.split(".")[2]
    if kind in ("control", "admit") or subject.endswith((".coordinator", ".consensus")):
        return "coordinator"
    return f"rank-{subject.rsplit('.', 1)[1]}"


async def publish_matrix(logins: dict[str, Login]) -> int:
    """Each identity publishes on each subject: the observer (subscribed to the whole job)
    receives what the server let pass; the server refuses the rest."""
    seen: dict[bytes, asyncio.Event] = {}

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        if msg.data in seen:
            seen[msg.data].set()

    await logins["observer"].nc.subscribe(f"{P}.>", cb=on_msg)
    await logins["observer"].nc.flush()
    for subject, allowed in PUBLISH.items():
        for identity in IDENTITIES:
            me = logins[identity]
            token = f"{identity} on {subject}".encode()
            seen[token] = asyncio.Event()
            if identity not in allowed:
                await me.nc.publish(subject, token)
                await me.nc.flush()
                await me.refused("publish", subject)
                continue
            # core NATS is at-most-once: an allowed publish is repeated every 50 ms until
            # the observer has it (a refusal would show in the publisher's errors)
            deadline = time.monotonic() + WAIT_S
            while not seen[token].is_set():
                assert time.monotonic() < deadline, (
                    f"not delivered: {token.decode()}; publisher's errors {me.errors}, "
                    f"observer's {logins['observer'].errors}")
                await me.nc.publish(subject, token)
                await me.nc.flush()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(seen[token].wait(), 0.05)
    return len(PUBLISH) * len(IDENTITIES)


async def subscribe_matrix(logins: dict[str, Login]) -> int:
    """Each identity subscribes to each subject: an allowed one receives what its rightful
    sender publishes there; the server refuses the rest."""
    for subject, allowed in SUBSCRIBE.items():
        for identity in IDENTITIES:
            me = logins[identity]
            got = asyncio.Event()

            async def hit(_msg: nats.aio.msg.Msg, got: asyncio.Event = got) -> None:
                got.set()

            sub = await me.nc.subscribe(subject, cb=hit)
            await me.nc.flush()
            if identity not in allowed:
                await me.refused("subscription", subject)
                continue
            sender = logins[sender_of(subject)].nc
            deadline = time.monotonic() + WAIT_S
            while not got.is_set():  # a probe every 50 ms until one arrives
                assert time.monotonic() < deadline, f"{identity} got nothing on {subject}"
                await sender.publish(subject, b"probe")
                await sender.flush()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(got.wait(), 0.05)
            await sub.unsubscribe()
    return len(SUBSCRIBE) * len(IDENTITIES)


def test_the_identity_subject_matrix(secured: tuple[str, Path]) -> None:
    url, creds = secured

    async def main() -> int:
        logins = {i: await login(url, creds, i) for i in IDENTITIES}
        try:
            return await publish_matrix(logins) + await subscribe_matrix(logins)
        finally:  # a failed check must not leave sockets for a later test to collect
            for one in logins.values():
                await one.nc.close()

    assert asyncio.run(main()) == len(IDENTITIES) * (len(PUBLISH) + len(SUBSCRIBE))


def test_a_rank_cannot_reach_another_ranks_stream_or_the_coordinators_state(
        secured: tuple[str, Path]) -> None:
    url, creds = secured

    async def main() -> None:
        opened: list[Login] = []
        try:
            await checks(opened)
        finally:  # a failed check must not leave sockets for a later test to collect
            for one in opened:
                await one.nc.close()

    async def checks(opened: list[Login]) -> None:
        coordinator = await login(url, creds, "coordinator")
        opened.append(coordinator)
        await ensure_job(coordinator.nc.jetstream(), JOB, 2)  # the coordinator provisions
        rank = await login(url, creds, "rank-1")
        opened.append(rank)
        js = rank.nc.jetstream()
        mine = await js.consumer_info(STREAM, "rank-1")  # its own: allowed
        assert mine.config.filter_subjects == sj.rank_filters(JOB, 1)
        kv = await js.key_value(sj.kv_bucket(JOB))
        assert await kv.put("generation.rank-1", b"7") > 0  # its own counter
        refusals = [  # (what the rank tries, the API subject the server refuses)
            (js.consumer_info(STREAM, "rank-0", timeout=1),
             f"$JS.API.CONSUMER.INFO.{STREAM}.rank-0"),
            (js.add_consumer(STREAM, durable_name="spy", filter_subject=f"{P}.control.rank.0",
                             timeout=1), f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.spy"),
            (js.get_msg(STREAM, 1, direct=True), f"$JS.API.DIRECT.GET.{STREAM}"),
            (js.get_msg(STREAM, 1), f"$JS.API.STREAM.MSG.GET.{STREAM}"),
            (js.delete_stream(STREAM), f"$JS.API.STREAM.DELETE.{STREAM}"),
            (js.delete_consumer(STREAM, "rank-0"), f"$JS.API.CONSUMER.DELETE.{STREAM}.rank-0"),
            (kv.put("generation.rank-0", b"9"), f"$KV.{sj.kv_bucket(JOB)}.generation.rank-0"),
            (kv.put("coordinator.lease", b"{}"), f"$KV.{sj.kv_bucket(JOB)}.coordinator.lease"),
            (kv.put("coordinator.snapshot", b"x"),
             f"$KV.{sj.kv_bucket(JOB)}.coordinator.snapshot"),
        ]
        for call, subject in refusals:
            with pytest.raises(TimeoutError):  # nats-py's own or the wait's
                await asyncio.wait_for(call, 2)  # the request never reaches JetStream
            await rank.refused("publish", subject)
        # another rank's pull requests: refused, and nothing is delivered
        await rank.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.rank-0", b'{"batch":1}',
                              reply=f"{sj.inbox_prefix(JOB, 'rank-1')}.x")
        await rank.refused("publish", f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.rank-0")
        # the observer reads, never writes
        observer = await login(url, creds, "observer")
        opened.append(observer)
        okv = await observer.nc.jetstream().key_value(sj.kv_bucket(JOB))
        assert (await okv.get("generation.rank-1")).value == b"7"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(okv.put("coordinator.lease", b"{}"), 2)
        await observer.refused("publish", f"$KV.{sj.kv_bucket(JOB)}.coordinator.lease")

    asyncio.run(main())


def test_no_credentials_or_a_foreign_key_is_turned_away_at_once(
        secured: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = secured
    stranger = auth.write_credentials(tmp_path / "stranger", JOB, 1)  # the right names,
    # other keys: the server knows only the public keys it was started with
    for who in (None, auth.NatsAuth(nkey=stranger.seed("coordinator"))):
        started = time.monotonic()
        with pytest.raises(BusUnavailable, match=r"refused .* login"):
            asyncio.run(auth.Access(url=url, auth=who, identity="coordinator").connect(
                JOB, name="stranger", deadline=timedelta(seconds=20)))
        assert time.monotonic() - started < 10  # not retried until the deadline


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp / "server.pem", tmp / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_tls_admits_the_client_that_trusts_the_ca(tmp_path: Path) -> None:
    from ddpbus.orchestrator.runtime.nats_server import BrokerConfig, EmbeddedBroker

    cert, key = _self_signed(tmp_path)
    with EmbeddedBroker(BrokerConfig(tls_cert=cert, tls_key=key)) as broker:
        async def main() -> None:
            ok = auth.Access(url=broker.url, auth=auth.NatsAuth(tls_ca=cert))
            nc = await ok.connect(JOB, name="tls")
            assert nc.is_connected
            await nc.close()
            # no CA to trust its self-signed certificate: refused at once, not retried
            started = time.monotonic()
            with pytest.raises(BusUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
                await auth.Access(url=broker.url).connect(
                    JOB, name="untrusting", deadline=timedelta(seconds=20))
            assert time.monotonic() - started < 10

        asyncio.run(main())


def test_the_coordinators_identity_deletes_its_job(secured: tuple[str, Path]) -> None:
    """`ddpbus delete-job` with the coordinator's seed, as an operator runs it on a secured
    broker: its rights cover the job's four streams (stream, KV, two Object Stores)."""
    url, creds = secured

    mine = [name for _, name in teardown.owned(JOB)]

    async def provision() -> None:
        coordinator = await login(url, creds, "coordinator")
        try:
            js = coordinator.nc.jetstream()
            await ensure_job(js, JOB, 2)
            for name in mine:
                await js.stream_info(name)  # each is there (listing streams is not allowed)
        finally:
            await coordinator.nc.close()

    asyncio.run(provision())
    # a rank's identity may not: the server drops the requests, nothing is deleted
    rank = delete_job(url, JOB, "--force", "--nats-nkey", str(creds / "rank-0.nk"))
    assert rank.returncode == 1
    assert "nothing was deleted); on a secured broker delete-job needs the job " \
        "coordinator's identity" in rank.stderr
    asyncio.run(provision())  # every stream is still there
    out = delete_job(url, JOB, "--force", "--nats-nkey", str(creds / "coordinator.nk"))
    assert out.returncode == 0, out.stderr
    assert [line.split(" (")[0].split()[-1] for line in out.stdout.splitlines()] == mine
    after = delete_job(url, JOB, "--nats-nkey", str(creds / "coordinator.nk"))
    assert after.returncode == 1
    assert f"the broker holds no job {JOB!r}" in after.stderr


async def _api(me: Login, subject: str, body: dict[str, object] | None = None
               ) -> dict[str, object]:
    """One JetStream API request, answered without error (on the identity's own inbox)."""
    msg = await me.nc.request(subject, json.dumps(body or {}).encode(), timeout=WAIT_S)
    reply: dict[str, object] = json.loads(msg.data)
    assert "error" not in reply, (subject, reply, me.errors)
    return reply


def _consumer(name: str, **config: object) -> dict[str, object]:
    return {"stream_name": STREAM, "action": "create",
            "config": {"name": name, "deliver_policy": "all", "ack_policy": "none",
                       "mem_storage": True, "num_replicas": 1,
                       "inactive_threshold": 30_000_000_000, **config}}


async def _kept_off_the_jobs_durables(observer: Login) -> None:
    """Never the job's durables (a pull or an ack there takes a rank's messages), never the
    job's subjects."""
    nc = observer.nc
    for durable in ("coordinator", "rank-0", "rank-1"):
        for subject in (f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{durable}",
                        f"$JS.API.CONSUMER.CREATE.{STREAM}.{durable}",
                        f"$JS.API.CONSUMER.CREATE.{STREAM}.{durable}.{P}.control.all",
                        f"$JS.API.CONSUMER.DELETE.{STREAM}.{durable}",
                        f"$JS.ACK.{STREAM}.{durable}.1.1.1.1.0"):
            await nc.publish(subject, b"{}")
            await nc.flush()
            await observer.refused("publish", subject)
    await nc.publish(f"{P}.control.all", b"forged")
    await nc.flush()
    await observer.refused("publish", f"{P}.control.all")


async def _natscli_reads(url: str, creds: Path) -> None:
    coordinator = await login(url, creds, "coordinator")
    observer = await login(url, creds, "observer")
    nc = observer.nc
    try:
        js = coordinator.nc.jetstream()
        await ensure_job(js, JOB, 2)
        first = (await js.stream_info(STREAM)).state.last_seq + 1
        for i in range(3):
            await js.publish(f"{P}.control.all", f"m{i}".encode())
        tail = {"opt_start_seq": first, "deliver_policy": "by_start_sequence"}

        # `nats stream view`: account and stream info, a named pull consumer, a page of
        # messages, the consumer deleted
        await _api(observer, "$JS.API.INFO")
        await _api(observer, f"$JS.API.STREAM.INFO.{STREAM}")
        await _api(observer, f"$JS.API.CONSUMER.CREATE.{STREAM}.view1", _consumer("view1",
                                                                                 **tail))
        page = await nc.subscribe(nc.new_inbox())
        await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.view1",
                         json.dumps({"batch": 3, "expires": 5_000_000_000}).encode(),
                         reply=page.subject)
        got = [(await page.next_msg(timeout=WAIT_S)).data for _ in range(3)]
        assert got == [b"m0", b"m1", b"m2"]
        await _api(observer, f"$JS.API.CONSUMER.DELETE.{STREAM}.view1")

        # `nats sub --stream SUBJECT`: an ordered push consumer filtered on the subject (the
        # filter ends the create subject), with idle heartbeats and flow control answered
        deliver = await nc.subscribe(nc.new_inbox())
        await _api(observer, f"$JS.API.CONSUMER.CREATE.{STREAM}.ord1.{P}.control.all",
                   _consumer("ord1", deliver_subject=deliver.subject, flow_control=True,
                             idle_heartbeat=1_000_000_000, filter_subject=f"{P}.control.all",
                             max_deliver=1, **tail))
        data: list[bytes] = []
        while len(data) < 3:
            msg = await deliver.next_msg(timeout=WAIT_S)
            if msg.headers and msg.headers.get("Status") == "100":  # heartbeat or FC
                if msg.reply:
                    await nc.publish(msg.reply, b"")
                continue
            data.append(msg.data)
        assert data == [b"m0", b"m1", b"m2"]
        await _api(observer, f"$JS.API.CONSUMER.DELETE.{STREAM}.ord1")

        # `nats consumer add` + `nats consumer next`: a durable of its own, pulled and acked
        await _api(observer, f"$JS.API.CONSUMER.CREATE.{STREAM}.tail",
                   _consumer("tail", durable_name="tail", ack_policy="explicit", **tail))
        await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.tail",
                         json.dumps({"batch": 1}).encode(), reply=page.subject)
        one = await page.next_msg(timeout=WAIT_S)
        assert one.data == b"m0"
        await nc.request(one.reply, b"+ACK", timeout=WAIT_S)  # `next` acks, and waits
        state = await _api(observer, f"$JS.API.CONSUMER.INFO.{STREAM}.tail")
        assert state["num_ack_pending"] == 0
        assert state["num_pending"] == 2
        await _api(observer, f"$JS.API.CONSUMER.DELETE.{STREAM}.tail")

        await _kept_off_the_jobs_durables(observer)
        # rank 0's durable still holds the three messages for rank 0, none taken
        rank0 = await js.consumer_info(STREAM, sj.rank_consumer(0))
        assert rank0.num_pending >= 3
        assert rank0.num_ack_pending == 0
    finally:
        await observer.nc.close()
        await coordinator.nc.close()


def test_natscli_stream_readers_work_with_the_observer_login(secured: tuple[str, Path]
                                                             ) -> None:
    """The JetStream calls of `nats stream view`, `nats sub --stream` and `nats consumer
    next` (with `--inbox-prefix _INBOX.<job>.observer`), made by nats.py as the observer."""
    asyncio.run(_natscli_reads(*secured))
