"""The command-line vocabulary every subcommand shares: the engine flags (`kvplay`, `run`,
`replay`, `lab`, `bench`, `screenshot`) and how they combine with a script's `[engine]` table,
`--db`, the one-line user error (KvplayError) and output-path checks.

Layers (pyproject.toml, [tool.importlinter]): its own layer, directly above the engine (it needs
EngineConfig and EngineError) and below everything else, so every layer that raises KvplayError
or saves a plot uses it without importing the CLI above them.

Flags given on the command line override the script; flags left out keep the script's value,
then the EngineConfig default.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from kvplay.engine.config import EVICTION_POLICIES, ISOLATION_MODES, EngineConfig
from kvplay.engine.errors import EngineError

# flag -> (dest, type, help)
ENGINE_FLAGS = [
    ("--model", "model", str, "default (embedded SmolLM2-135M-Instruct), tiny:llama|tiny:qwen2, a local path or a HF id"),
    ("--device", "device", str, "auto|cpu|cuda|mps"),
    ("--dtype", "dtype", str, "auto|float32|bfloat16|float16"),
    ("--block-size", "block_size", int, "tokens per KV block (default 16)"),
    ("--cache-mb", "cache_mb", float, "size of the block pool in MiB (default 256)"),
    ("--num-blocks", "num_blocks", int, "size of the pool in blocks (overrides --cache-mb)"),
    ("--hash", "hash", str, "block hash: sha256 (default), sha256_cbor (vLLM's), blake2b64, builtin, trunc:N"),
    ("--isolation", "isolation", str, "who shares blocks: " + ", ".join(ISOLATION_MODES)),
    ("--eviction", "eviction", str, "eviction policy: " + ", ".join(EVICTION_POLICIES)),
    ("--prefill-budget", "prefill_budget", int, "prompt tokens computed per scheduler step (default 1024)"),
    ("--max-running", "max_running", int, "requests decoding at once (default 16)"),
    ("--hash-seed", "hash_seed", str, "root of every hash chain (default 'kvplay')"),
    ("--threads", "threads", int, "torch CPU threads (default: cores - 1)"),
]


DB_HELP = "sessions database (default: XDG data dir, env KVPLAY_DB)"


def add_db_arg(parser: argparse.ArgumentParser, help: str = DB_HELP) -> None:
    """`--db PATH`, the sessions database every recording or reading command takes."""
    parser.add_argument("--db", default=None, help=help)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    for flag, dest, typ, help_ in ENGINE_FLAGS:
        g.add_argument(flag, dest=dest, type=typ, default=None, help=help_)
    g.add_argument("--deterministic", dest="deterministic", action="store_const", const=True, default=None,
                   help="bitwise-reproducible logits: cached == cold, whatever shares the batch")
    g.add_argument("--no-verify", dest="verify_on_hit", action="store_const", const=False, default=None,
                   help="trust the hash on a hit (do not compare stored tokens)")
    g.add_argument("--no-packed-weights", dest="packed_weights", action="store_const", const=False,
                   default=None, help="CPU: F.linear on the plain weights, not oneDNN's packed copies "
                   "(saves one copy of the weights' memory; slower steps)")
    g.add_argument("--no-cascade-attention", dest="cascade_attention", action="store_const", const=False,
                   default=None, help="CPU: every decode row attends over all its keys itself, not "
                   "over a shared prefix once for all the rows holding its blocks")
    g.add_argument("--no-native-attention", dest="native_attention", action="store_const", const=False,
                   default=None, help="CPU: decode rows and prompt chunks attend through torch's ops, not "
                   "the compiled paged-attention kernels (built with the host's C compiler on first use)")
    g.add_argument("--no-fused-ops", dest="fused_ops", action="store_const", const=False, default=None,
                   help="CPU: the norms, rotary and SiLU between the GEMMs as torch's ops, not "
                   "the compiled passes (built with the attention kernels)")


def engine_overrides(args: argparse.Namespace) -> dict:
    """Only the engine flags the user actually gave."""
    names = [dest for _, dest, _, _ in ENGINE_FLAGS] + ["deterministic", "verify_on_hit", "packed_weights",
                                                       "cascade_attention", "native_attention", "fused_ops"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def config_from_args(args: argparse.Namespace, base: dict | None = None, where: str = "[engine]") -> EngineConfig:
    cfg = EngineConfig.from_dict(base or {}, where)
    return cfg.replace(**engine_overrides(args)).validate()


class KvplayError(EngineError):
    """A user-facing error outside the engine (bad script, bad DB, unknown session)."""


def check_output_file(path: str | None, flag: str, suffix: str | None = None) -> None:
    """Refuse an output path that cannot be written *before* minutes of work, not after."""
    if not path:
        return
    if suffix and not path.lower().endswith(suffix):
        raise KvplayError(f"{flag} {path!r}: give a {suffix} file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):  # never created: a typo makes no directories
        raise KvplayError(f"{flag} {path!r}: no such directory: {folder}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise KvplayError(f"{flag} {path!r}: not writable")


MAX_JSON_FILE = 64 << 20  # a report another command wrote (serve_compare's --json, a lab's --json)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def read_text_file(path: str, limit: int, label: str = "") -> str:
    """A small file's UTF-8 text, read no further than `limit` bytes; unreadable, larger or not
    UTF-8 is one line (KvplayError) naming `label` (e.g. "--key-file ") and the path."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise KvplayError(f"{label}{path}: {exc.strerror or exc}") from None
    if len(raw) > limit:
        raise KvplayError(f"{label}{path}: larger than {limit:,} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise KvplayError(f"{label}{path}: not UTF-8 text") from None


def read_json_file(path: str, limit: int | None = None):
    """A JSON file another command wrote, as Python objects; unreadable, too large (`limit` bytes,
    default MAX_JSON_FILE), not UTF-8, not JSON, or holding NaN/Infinity is one line
    (KvplayError), never a traceback."""
    text = read_text_file(path, MAX_JSON_FILE if limit is None else limit)
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise KvplayError(f"{path}: nested too deeply") from None
    except ValueError as exc:  # json.JSONDecodeError too
        raise KvplayError(f"{path}: not JSON ({str(exc).splitlines()[0][:120]})") from None


def check_url(url: str) -> str:
    """A server's base URL (http/https, a host); a trailing /v1 is dropped (the routes add it)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise KvplayError(f"URL {url!r}: give the server's base URL, like http://127.0.0.1:8000")
    try:
        parts.port
    except ValueError:
        raise KvplayError(f"URL {url!r}: the port is not a number") from None
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def save_plot(save, path: str) -> None:
    """Run `save(path)`; a failure is one line, not a traceback after the measurements."""
    try:
        save(path)
    except OSError as exc:
        raise KvplayError(f"could not save the plot to {path}: {exc.strerror or exc}") from None
    print(f"kvplay: plot saved to {path}", file=sys.stderr)


def plot_files_main(prog: str, description: str, what: str, load, figure, argv: list[str] | None = None) -> int:
    """The main of a script that draws JSON reports into one PNG: `prog FILE.json… -o OUT.png`;
    `load(path)` reads one file, `figure(loaded, plt)` draws them; a bad file or output is one
    line and exit 2."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("files", nargs="+", metavar="FILE.json", help=what)
    ap.add_argument("-o", "--out", required=True, metavar="OUT.png")
    args = ap.parse_args(argv)
    try:
        check_output_file(args.out, "-o", ".png")
        loaded = [load(p) for p in args.files]
        plt = pyplot()
        fig = figure(loaded, plt)
        try:
            save_plot(lambda path: fig.savefig(path, dpi=110), args.out)
        finally:
            plt.close(fig)
    except KvplayError as exc:
        print(f"{Path(prog).stem}: {exc}", file=sys.stderr)
        return 2
    return 0


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), imported when a plot is asked for."""
    # Lazy, kvplay's one import of matplotlib: 0.3-0.7 s niced on the 2-core machine, paid by --plot alone.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
