"""What a request asks of sampling (greedy, temperature, top-k, top-p, a seed), checked; a plain
dataclass without torch, so scripts, recordings and watched servers can carry it (the sampling
itself, with torch, is engine/sampling.py)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .errors import EngineError


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 64
    seed: int | None = None  # None: derived from the request id
    stop_on_eos: bool = True

    def validate(self) -> "SamplingParams":
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise EngineError(f"{name} must be a finite number (got {v!r})")
        if self.temperature < 0:
            raise EngineError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise EngineError(f"top_k must be >= 0 (got {self.top_k})")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise EngineError(f"max_tokens must be a positive integer (got {self.max_tokens!r})")
        return self

    def to_dict(self) -> dict:
        return asdict(self)
