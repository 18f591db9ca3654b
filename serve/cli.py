"""`kvplay serve [engine flags] [--host 127.0.0.1] [--port 8000] [--api-keys FILE]
[--kv-events-config JSON] [--db PATH] [--no-record]`: the engine as an OpenAI-compatible server
that publishes vLLM's KV events.

Without --api-keys the server is a playground on one machine: loopback only, user names from
the body's `user`, shared isolation only (a name the client picks isolates nothing). With keys,
each bearer token is one user (and group), and any isolation mode applies.
"""
from __future__ import annotations

import argparse
import signal
import ssl
import sys

from kvplay.options import KvplayError, add_db_arg, add_engine_args, config_from_args


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--api-keys", default=None, metavar="FILE",
                        help='TOML: [[keys]] key = "…" user = "alice" group = "team-a"; one user per key')
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help="vLLM's KV-events JSON, e.g. "
                             '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                             '"replay_endpoint": "tcp://*:5558"}\'')
    parser.add_argument("--kv-cache-report-mode", choices=("incremental", "full"), default="incremental",
                        help="default for requests without vllm_xargs.kv_cache_report_mode: 'full' re-announces "
                             "reused blocks with the reusing user's session_id")
    parser.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    parser.add_argument("--ssl-certfile", default=None, help="… and this certificate (PEM): bearer keys then never cross the network in clear")
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: the model's)")
    add_db_arg(parser)
    parser.add_argument("--no-record", action="store_true", help="do not record this server's turns")
    parser.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                        help="uvicorn's log level (default warning)")
    add_engine_args(parser)


def _stop_on_sigterm(signum, frame):
    raise SystemExit(0)


def main(args: argparse.Namespace) -> int:
    # start-up time: imported when this first runs
    from kvplay.sessions.recorder import Recorder, close_run
    from kvplay.sessions.run_cmd import start_engine
    from kvplay.sessions.store import open_db
    from kvplay.wire.publisher import KVEventsConfig

    from .keys import load_keys
    from .server import bind_socket, build_state, close_state, is_loopback, serve_forever

    if not 0 <= args.port <= 65535:
        raise KvplayError(f"--port must be 0..65535 (got {args.port})")
    keys = load_keys(args.api_keys) if args.api_keys else None
    config = config_from_args(args)
    loopback = is_loopback(args.host)
    if keys is None and not loopback:
        raise KvplayError(f"--host {args.host}: without --api-keys kvplay serve listens on loopback only "
                          "(anyone could claim any user); give --api-keys FILE to serve other machines")
    if keys is None and config.isolation != "shared":
        raise KvplayError(f"--isolation {config.isolation} needs --api-keys: without keys the user name comes "
                          "from the request body, and a salt the client picks isolates nothing")
    kv_cfg = KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise KvplayError("--ssl-keyfile and --ssl-certfile go together")
    if args.ssl_certfile:
        try:  # before minutes of model loading
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        except OSError as exc:
            raise KvplayError(f"--ssl-certfile/--ssl-keyfile: {exc.strerror or exc}") from None
    if not args.no_record:
        open_db(args.db).close()  # refuse a bad DB before spending time on the model
    sock = bind_socket(args.host, args.port)
    engine = start_engine(config)
    rec = state = None
    try:
        if not args.no_record:
            rec = Recorder.open(args.db, config, engine.model_name, "serve", "",
                                title=f"kvplay serve on {args.host}:{args.port}")
        state = build_state(engine, keys, kv_cfg, loopback=loopback, report_full=args.kv_cache_report_mode == "full",
                            recorder=rec, served_name=args.served_model_name)
        host = f"[{args.host}]" if ":" in args.host else args.host
        who = (f"{len(keys)} API keys ({', '.join(sorted({i.user for i in keys.values()}))})" if keys
               else "no API keys: user from the body's `user`")
        scheme = "https" if args.ssl_certfile else "http"
        print(f"kvplay: serving {state.model_name} on {scheme}://{host}:{sock.getsockname()[1]}/v1 — {who}, "
              f"isolation {config.isolation}", file=sys.stderr, flush=True)
        if state.events is not None:
            pub = state.events.publisher
            print(f"kvplay: KV events {'bound on' if pub.binds else 'connecting to'} {pub.endpoint}"
                  + (f", replay on {pub.replay_endpoint}" if pub.replay_endpoint else ""), file=sys.stderr, flush=True)
        if rec is not None:
            print(f"kvplay: recording session {rec.session_id} in {rec.path}", file=sys.stderr, flush=True)
        # uvicorn stops gracefully on SIGINT/SIGTERM, then re-raises the signal: make SIGTERM an
        # exception too (not the default instant exit), so the session is closed and the engine stopped
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
        serve_forever(state, sock, args.log_level, args.ssl_keyfile, args.ssl_certfile)
    finally:
        if state is not None:
            close_state(state)
        sock.close()
        close_run(rec, engine)
    return 0
