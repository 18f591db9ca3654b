"""Block hashing: H(parent hash, token ids, extra keys), chained over full blocks.

Extra keys are typed tuples (``("salt", "user:alice")``, ``("model", name)``) serialised with
their type tag, so a salt can never equal some other key's string (vLLM #44701). The salt goes
into the first block that needs it; chaining carries it to every later block.

Hashes are Python ints (``bits`` wide) so that the same code serves sha256 (256 bits), blake2b64,
Python's builtin ``hash`` (64 bits) and ``trunc:N`` (the top N bits of sha256, for the collision
lab).
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

from .cbor_hash import CborBlockHashing
from .errors import EngineError

ExtraKey = tuple[str, str]


@dataclass(frozen=True)
class HashFn:
    name: str
    bits: int
    fn: Callable[[bytes], int]

    def __call__(self, data: bytes) -> int:
        return self.fn(data)

    def hex(self, value: int) -> str:
        return format(value, "0%dx" % max(1, (self.bits + 3) // 4))


def _sha256(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


def _blake2b64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _builtin(data: bytes) -> int:
    # Python's hash of bytes is salted per process unless PYTHONHASHSEED is set, exactly the
    # property that made vLLM's old builtin hashing unreproducible across restarts.
    return hash(data) & 0xFFFFFFFFFFFFFFFF


def parse_hash_name(name: str) -> HashFn:
    if name == "sha256":
        return HashFn(name, 256, _sha256)
    if name == "sha256_cbor":  # vLLM's hash (cbor_hash.py); BlockHasher hashes blocks its way
        return HashFn(name, 256, _sha256)
    if name == "blake2b64":
        return HashFn(name, 64, _blake2b64)
    if name == "builtin":
        return HashFn(name, 64, _builtin)
    if name.startswith("trunc:"):
        try:
            bits = int(name.split(":", 1)[1])
        except ValueError:
            bits = -1
        if not 1 <= bits <= 256:
            raise EngineError(f"--hash {name!r}: N must be an integer from 1 to 256")
        shift = 256 - bits
        return HashFn(name, bits, lambda data, s=shift: _sha256(data) >> s)
    raise EngineError(f"unknown hash {name!r} (sha256, sha256_cbor, blake2b64, builtin, trunc:N)")


def _encode(parent: int | None, tokens: Sequence[int], extra: Sequence[ExtraKey]) -> bytes:
    parts = [b"P", b"-" if parent is None else parent.to_bytes(32, "big"),
             b"T", struct.pack(f"<{len(tokens)}q", *tokens)]
    for kind, value in extra:
        k, v = kind.encode(), value.encode()
        parts.append(b"E" + struct.pack("<II", len(k), len(v)) + k + v)
    return b"".join(parts)


class BlockHasher:
    """Computes the chained hashes of a token sequence's full blocks."""

    def __init__(self, hash_name: str, block_size: int, seed: str = "kvplay"):
        self.fn = parse_hash_name(hash_name)
        self.block_size = block_size
        self.root = self.fn(b"kvplay-root\0" + seed.encode())
        self._cbor = None
        if self.fn.name == "sha256_cbor":  # vLLM's bytes; the default seed means vLLM's NONE_HASH rule
            self._cbor = CborBlockHashing(None if seed == "kvplay" else seed)
            self.root = self._cbor.root_int

    def block_hash(self, parent: int | None, tokens: Sequence[int], extra: Sequence[ExtraKey] = ()) -> int:
        if self._cbor is not None:
            return self._cbor(parent, tokens, extra)
        return self.fn(_encode(self.root if parent is None else parent, tokens, extra))

    def chain(self, tokens: Sequence[int], extras: Sequence[Sequence[ExtraKey]] | None = None,
              start_parent: int | None = None, start_block: int = 0) -> list[int]:
        """Hashes of every full block of `tokens` from block `start_block` on.

        `extras[i]` are the extra keys of block i (usually only block 0's, or the first
        salted block's, are non-empty).
        """
        bs = self.block_size
        out: list[int] = []
        parent = start_parent
        for i in range(start_block, len(tokens) // bs):
            extra = extras[i] if extras is not None and i < len(extras) else ()
            parent = self.block_hash(parent, tokens[i * bs:(i + 1) * bs], extra)
            out.append(parent)
        return out

    def hex(self, value: int | None) -> str | None:
        return None if value is None else self.fn.hex(value)


def salt_for(isolation: str, user: str, group: str | None) -> ExtraKey | None:
    """The salt the engine derives from who is asking; clients never choose it.

    The value is typed by kind ("user:NAME" or "group:NAME"): a group named like a user never
    gets that user's salt. Under `group` isolation a user without a group is private.
    """
    if isolation == "shared":
        return None
    if isolation == "group" and group is not None:
        return ("salt", "group:" + group)
    return ("salt", "user:" + user)  # "user", "system", and "group" for a user with no group


def salted_extras(isolation: str, salt: ExtraKey | None, model_key: str, num_blocks: int,
                  system_tokens: int, block_size: int) -> list[list[ExtraKey]]:
    """Extra keys for each of `num_blocks` blocks of a prompt, given its salt.

    Block 0 always carries the model key. The salt goes into block 0, except in `system`
    isolation where blocks wholly inside the shared system prompt stay unsalted and the salt
    enters at the first block that reaches past it.
    """
    extras: list[list[ExtraKey]] = [[] for _ in range(num_blocks)]
    if num_blocks == 0:
        return extras
    extras[0].append(("model", model_key))
    if salt is None:
        return extras
    first_salted = 0
    if isolation == "system":
        first_salted = system_tokens // block_size  # blocks [0, first_salted) are all system prompt
    if first_salted < num_blocks:
        extras[first_salted].append(salt)
    return extras


def block_extras(isolation: str, user: str, group: str | None, model_key: str,
                 num_blocks: int, system_tokens: int, block_size: int) -> list[list[ExtraKey]]:
    """Extra keys for each of `num_blocks` blocks of `user`'s prompt (see `salted_extras`)."""
    return salted_extras(isolation, salt_for(isolation, user, group), model_key, num_blocks,
                         system_tokens, block_size)
