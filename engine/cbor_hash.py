"""vLLM's `sha256_cbor` block hash, so the same tokens hash the same in kvplay and in vLLM.

vLLM (v1/core/kv_cache_utils.py, utils/hashing.py):

    sha256_cbor(x)  = sha256(cbor2.dumps(x, canonical=True)).digest()
    NONE_HASH       = sha256_cbor(seed)      seed = $PYTHONHASHSEED, else "vllm-none-hash"
    block_hash      = sha256_cbor((parent_digest or NONE_HASH, tuple(tokens), extra_keys))

`extra_keys` is None for a plain block, else a tuple of tagged keys; a cache salt enters the
first block as ``("cache_salt", salt)``. Parents chain on the full 32-byte digest; on the wire
a hash is the low 64 bits as an int (`wire_hash`), or the whole digest with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``.

kvplay's own extra keys map onto vLLM's: the ``("model", …)`` key is dropped (vLLM does not
hash the model: one server serves one model), and a salt kvplay derived from the bound identity
becomes a ``("cache_salt", "kind:value")`` key. So a shared-isolation prompt hashes exactly as
vLLM hashes it without a cache salt.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

import cbor2

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash_seed() -> str:
    """vLLM's rule for a cryptographic hash: PYTHONHASHSEED if set, else a fixed seed."""
    seed = os.environ.get("PYTHONHASHSEED")
    return DEFAULT_NONE_HASH_SEED if seed is None else seed


def none_hash(seed: str | None = None) -> bytes:
    return sha256_cbor(none_hash_seed() if seed is None else seed)


def vllm_extra_keys(extras: Sequence[tuple[str, str]]) -> tuple | None:
    """kvplay's typed extra keys of one block -> vLLM's hashed extra keys (None when empty)."""
    keys = tuple(("cache_salt", f"{kind}:{value}") for kind, value in extras if kind != "model")
    return keys or None


def block_hash(parent: bytes | None, tokens: Sequence[int], extra_keys: tuple | None,
               root: bytes | None = None) -> bytes:
    """vLLM's hash_block_tokens with sha256_cbor (`root` = NONE_HASH, computed if not given)."""
    if not parent:
        parent = none_hash() if root is None else root
    return sha256_cbor((parent, tuple(int(t) for t in tokens), extra_keys))


def wire_hash(digest: bytes | int, as_int: bool | None = None) -> int | bytes:
    """A hash as vLLM publishes it: the low 64 bits as an int (default), or the digest bytes
    when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``."""
    if as_int is None:
        as_int = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"
    if isinstance(digest, int):
        if as_int:
            return digest & 0xFFFFFFFFFFFFFFFF
        return digest.to_bytes(max(8, (digest.bit_length() + 7) // 8), "big")
    return int.from_bytes(digest, "big") & 0xFFFFFFFFFFFFFFFF if as_int else bytes(digest)


class CborBlockHashing:
    """The engine's `sha256_cbor` hash (used by engine/prefix.py's BlockHasher): ints in and
    out, like every other kvplay hash, computed exactly as vLLM computes it."""

    def __init__(self, seed: str | None = None):
        self.root = none_hash(seed)
        self.root_int = int.from_bytes(self.root, "big")

    def __call__(self, parent: int | None, tokens: Sequence[int], extras: Sequence[tuple[str, str]]) -> int:
        parent_bytes = None if parent is None else parent.to_bytes(32, "big")
        return int.from_bytes(block_hash(parent_bytes, tokens, vllm_extra_keys(extras), self.root), "big")
