"""The coordinator's intake: what arrives, decoded and accounted for before the core sees it.

Every message from the stream and every live heartbeat passes :meth:`Intake.decode`: one that
fails decoding, signing or fencing is counted by reason (the run summary's
``decode_rejections``, the metrics), warned about once per reason and never reaches the
core. Heartbeats (core NATS) are held until the next tick and decoded together there
(:meth:`Intake.beats`): a thousand ranks beating once a second interleave no work with a
burst of reports that closes a window, and a rank is timed out only by a tick, after its
beats. The core's own refusals (``Refuse`` commands) are logged here the same way, once per
reason.
"""

from __future__ import annotations

import logging
from collections import Counter

from nats.aio.msg import Msg

from ddpbus.codecs import DecodeError, Decoder
from ddpbus.codecs import messages as m
from ddpbus.orchestrator.core.state import Refuse
from ddpbus.orchestrator.persist import journal

log = logging.getLogger(__name__)


class Intake:
    def __init__(self, decoder: Decoder, world_size: int) -> None:
        self.decoder = decoder
        self.world_size = world_size
        self.rejected: Counter[str] = Counter()  # messages the codec refused, by reason
        # what each rank's current incarnation refused, by reason (from its heartbeats)
        self.rank_rejected: dict[int, dict[str, int]] = {}
        self._warned: set[str] = set()  # core refusal reasons warned about
        self._beats: list[Msg] = []  # heartbeats since the last tick

    def decode(self, msg: Msg) -> tuple[m.Message | None, str]:
        """The message and its ``Nats-Msg-Id``; None for one refused by the codec."""
        try:
            env = self.decoder.decode(msg.subject, msg.headers, msg.data)
        except DecodeError as exc:
            self.rejected[exc.reason] += 1
            if self.rejected[exc.reason] == 1:
                log.warning("dropped a message (%s); further %s drops are counted only", exc,
                            exc.reason)
            return None, ""
        return env.message, env.msg_id  # type: ignore[return-value]

    def beat(self, msg: Msg) -> None:
        """A live heartbeat: held for the next tick."""
        self._beats.append(msg)

    def beats(self) -> list[tuple[m.Heartbeat, journal.Wire]]:
        """The heartbeats held since the last tick, decoded (core NATS, out of stream
        order: not deduplicated), with each rank's refusal counts taken from them."""
        held, self._beats = self._beats, []
        out = []
        for msg in held:
            body, _ = self.decode(msg)
            if not isinstance(body, m.Heartbeat):
                continue
            if body.rank < self.world_size:
                self.rank_rejected[body.rank] = dict(body.rejections)
            out.append((body, journal.Wire(msg.subject, msg.headers or {}, msg.data, False)))
        return out

    def refused(self, c: Refuse) -> None:
        """The core refused an input: warned once per reason (a thousand ranks may earn the
        same one), every one counted by the core (metrics, summary)."""
        if c.reason not in self._warned:
            self._warned.add(c.reason)
            log.warning("refused (%s): %s; further %s refusals are logged at debug level "
                        "(all counted: metrics, summary)", c.reason, c.detail, c.reason)
        else:
            log.debug("refused (%s): %s", c.reason, c.detail)
