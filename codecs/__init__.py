"""ddpbus.codecs: the only package that knows wire formats.

Domain messages (:mod:`.messages`), their protobuf twins and the conversions
(:mod:`.convert`), the envelope with headers, signature and fencing (:mod:`.envelope`),
tensor frames (:mod:`.tensor`) and the subjects contract (:mod:`.subjects`).
No NATS client and no torch.distributed here.
"""

from ddpbus.codecs.envelope import Decoder, Encoder, Envelope, Outbound
from ddpbus.codecs.errors import DdpbusError, DecodeError, EncodeError

__all__ = ["DdpbusError", "DecodeError", "Decoder", "EncodeError", "Encoder", "Envelope",
           "Outbound"]
