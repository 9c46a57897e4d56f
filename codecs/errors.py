"""The exception tree. Every ddpbus error derives from :class:`DdpbusError`.

Decoding raises exactly one family, :class:`DecodeError`; each subclass names one reason
(``err.reason`` is a stable short string for counters and logs). A decode error never
leaves state behind: the decoder is a pure function of its inputs.
"""

from __future__ import annotations


class DdpbusError(Exception):
    """Root of every error ddpbus raises on purpose."""


class ConfigError(DdpbusError, ValueError):
    """A flag, environment variable, config key or value is wrong."""


class EncodeError(DdpbusError, ValueError):
    """A domain message cannot be put on the wire (out-of-range field, oversize, reserved)."""


class DecodeError(DdpbusError, ValueError):
    """An inbound message was refused. ``reason`` names why; the message changed nothing."""

    reason = "decode"

    def __init__(self, detail: str, *, subject: str = "", msg_type: str = "") -> None:
        where = " ".join(p for p in (subject and f"subject={subject}", msg_type and
                                     f"type={msg_type}") if p)
        super().__init__(f"{self.reason}: {detail}" + (f" ({where})" if where else ""))
        self.detail = detail
        self.subject = subject
        self.msg_type = msg_type


class MalformedPayload(DecodeError):
    """The payload does not parse as the message its headers name."""

    reason = "malformed"


class OversizeMessage(DecodeError):
    """The payload exceeds the size cap; refused before parsing."""

    reason = "oversize"


class MissingHeader(DecodeError):
    """A required ``Ddpbus-*`` header is absent or unreadable."""

    reason = "missing-header"


class UnknownType(DecodeError):
    """``Ddpbus-Type`` names no message this schema knows."""

    reason = "unknown-type"


class WrongType(DecodeError):
    """The type is known but does not belong on this subject."""

    reason = "wrong-type"


class BadSubject(DecodeError):
    """The subject is not one of subjects.md's templates, or disagrees with the headers."""

    reason = "bad-subject"


class BadSignature(DecodeError):
    """``Ddpbus-Sig`` is missing or does not verify with the job key."""

    reason = "bad-signature"


class SchemaMismatch(DecodeError):
    """``Ddpbus-Schema`` names a wire schema version this build does not speak."""

    reason = "schema"


class ForeignJob(DecodeError):
    """The message belongs to another job."""

    reason = "foreign-job"


class StaleGeneration(DecodeError):
    """The sender's generation is below the fence: an old incarnation or deposed leader."""

    reason = "stale-generation"


class InvalidField(DecodeError):
    """A field parsed but breaks a protocol rule (reserved value, wrong length, missing)."""

    reason = "invalid-field"


class UnsupportedContentType(DecodeError):
    """``Content-Type`` is neither protobuf nor JSON."""

    reason = "content-type"


DECODE_ERRORS: tuple[type[DecodeError], ...] = (
    MalformedPayload,
    OversizeMessage,
    MissingHeader,
    UnknownType,
    WrongType,
    BadSubject,
    BadSignature,
    SchemaMismatch,
    ForeignJob,
    StaleGeneration,
    InvalidField,
    UnsupportedContentType,
)
"""Every concrete decode failure, for counters that want one slot per reason."""
