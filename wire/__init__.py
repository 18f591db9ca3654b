"""vLLM's KV-event wire: event types, msgpack encode/decode (map-tagged and legacy positional), sha256_cbor hashes, a ZMQ publisher with replay, and a subscriber with gap, replay and restart handling. No Textual, no model."""
from kvplay import only_as

only_as(__name__, "wire")
