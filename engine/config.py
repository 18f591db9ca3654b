"""Engine configuration: one dataclass, validated in one place.

Every front end (the app, ``kvplay run``, replay, labs, bench) builds an EngineConfig from the
same command-line flags (see kvplay/options.py) or a script's ``[engine]`` table.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .errors import EngineError
from .prefix import parse_hash_name

ISOLATION_MODES = ("shared", "user", "group", "system")
EVICTION_POLICIES = ("lru", "lfu", "fifo")
HASH_NAMES = ("sha256", "blake2b64", "builtin", "trunc:N")
# fields a running engine cannot change (Engine.reconfigure refuses them: they need a new engine)
RESTART_FIELDS = ("block_size", "model", "num_blocks", "cache_mb", "device", "dtype", "threads", "packed_weights",
                  "cascade_attention", "native_attention", "fused_ops")


@dataclass
class EngineConfig:
    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    cache_mb: float = 256.0
    num_blocks: int | None = None  # overrides cache_mb when set
    hash: str = "sha256"
    verify_on_hit: bool = True
    isolation: str = "shared"
    eviction: str = "lru"
    deterministic: bool = False
    prefill_budget: int = 1024  # max prompt tokens computed per scheduler step (chunked prefill; docs/bench.md)
    max_running: int = 16  # max requests decoding at once
    hash_seed: str = "kvplay"  # root of every hash chain (like vLLM's PYTHONHASHSEED NONE_HASH)
    threads: int | None = None  # torch CPU threads; None = one less than the cores (min 1)
    packed_weights: bool = True  # CPU GEMMs on weights prepacked for oneDNN (packed.py)
    cascade_attention: bool = True  # decode rows sharing prefix blocks attend over them once (cascade.py)
    native_attention: bool = True  # CPU float32: every row's attention by the compiled kernels (native.py)
    fused_ops: bool = True  # CPU float32: norms, rotary + K/V write, SiLU in compiled passes (native.py)

    def _check_types(self) -> None:
        """Scripts and DB rows reach here too: `deterministic = "false"` must not mean True."""
        for f in fields(self):
            v = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            if v is None and "None" in kind:
                continue
            if kind.startswith("bool"):
                ok = isinstance(v, bool)
            elif kind.startswith("int"):
                ok = isinstance(v, int) and not isinstance(v, bool)
            elif kind.startswith("float"):
                ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            else:
                ok = isinstance(v, str)
            if not ok:
                raise EngineError(f"{f.name} ({flag}) must be {kind.split(' ')[0]}, got {v!r}")

    def validate(self) -> "EngineConfig":
        self._check_types()
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise EngineError(f"--block-size must be a positive integer (got {self.block_size!r})")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks <= 0):
            raise EngineError(f"--num-blocks must be a positive integer (got {self.num_blocks!r})")
        if self.num_blocks is None and not (isinstance(self.cache_mb, (int, float)) and self.cache_mb > 0):
            raise EngineError(f"--cache-mb must be positive (got {self.cache_mb!r})")
        if self.isolation not in ISOLATION_MODES:
            raise EngineError(f"unknown isolation mode {self.isolation!r} ({', '.join(ISOLATION_MODES)})")
        if self.eviction not in EVICTION_POLICIES:
            raise EngineError(f"unknown eviction policy {self.eviction!r} ({', '.join(EVICTION_POLICIES)})")
        parse_hash_name(self.hash)  # raises EngineError on a bad name
        if self.prefill_budget < self.block_size:
            raise EngineError(f"--prefill-budget ({self.prefill_budget}) must be at least the block size ({self.block_size})")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise EngineError(f"--threads must be a positive integer (got {self.threads!r})")
        if self.max_running < 1:
            raise EngineError("--max-running must be at least 1")
        return self

    def pool_size_hint(self, num_blocks: int) -> str:
        """"the pool holds N blocks — raise --num-blocks" (the flag that set the pool's size)."""
        flag = "--num-blocks" if self.num_blocks is not None else "--cache-mb"
        return f"the whole pool holds {num_blocks} block{'' if num_blocks == 1 else 's'} — raise {flag}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "[engine]") -> "EngineConfig":
        names = {f.name: f for f in fields(cls)}
        kwargs = {}
        for key, value in d.items():
            name = key.replace("-", "_")
            if name not in names:
                raise EngineError(f"{where}: unknown engine option {key!r}")
            kwargs[name] = value
        return cls(**kwargs)

    def replace(self, **changes) -> "EngineConfig":
        """A copy with `changes` applied; None means "not given" (as with unset CLI flags), so
        a field cannot be reset to None this way."""
        d = self.to_dict()
        d.update({k: v for k, v in changes.items() if v is not None})
        return EngineConfig(**d)
