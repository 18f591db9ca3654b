"""`kvplay serve [engine flags] [--host 127.0.0.1] [--port 8000] [--api-keys FILE]
[--kv-events-config JSON] [--db PATH] [--no-record]`: the engine as an OpenAI-compatible server
that publishes vLLM's KV events.

Without --api-keys the server is a playground on one machine: loopback only (HTTP and KV
events), user names from the body's `user`, shared isolation only (a name the client picks
isolates nothing). With keys, each bearer token is one user (and group), isolation defaults to
`user` (`shared` must be asked for), and KV events off loopback need CURVE
(--kv-events-curve) or --kv-events-insecure.
"""
from __future__ import annotations

import argparse
import gc
import signal
import ssl
import sys

from kvplay.inert import inert
from kvplay.options import KvplayError, add_db_arg, add_engine_args, config_from_args
from kvplay.serve.core_client import RemoteSide
from kvplay.serve.keys import load_keys
from kvplay.sessions.recorder import close_run
from kvplay.sessions.store import open_db
from kvplay.wire import curve as wire_curve
from kvplay.wire.publisher import KVEventsConfig


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
    parser.add_argument("--kv-events-curve", default=None, metavar="DIR",
                        help="encrypt the KV-event sockets with ZMQ CURVE and admit only the subscribers whose "
                             "public keys are in DIR/clients (DIR/server.key_secret is the server's pair)")
    parser.add_argument("--kv-events-insecure", action="store_true",
                        help="publish KV events off loopback without CURVE: anyone who reaches the ports reads "
                             "every user's prompts")
    parser.add_argument("--gen-curve-keys", default=None, metavar="DIR",
                        help="write a server and a client CURVE key pair into DIR and exit")
    parser.add_argument("--max-concurrent-requests", type=int, default=None, metavar="N",
                        help="generation requests in flight at once; more get 503 + Retry-After (default 256)")
    parser.add_argument("--metrics-users", action="store_true",
                        help="show /metrics' per-user series (who reuses whose cache) to every caller, "
                             "not only to admin keys")
    parser.add_argument("--explain-across-keys", action="store_true",
                        help="with --api-keys, explain a miss from other keys' blocks too (isolated tokens "
                             "named for admins and counted in /metrics); off by default: that lookup takes "
                             "longer the further another key's identical prompt goes, which the sender can time")
    parser.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    parser.add_argument("--ssl-certfile", default=None, help="… and this certificate (PEM): bearer keys then never cross the network in clear")
    parser.add_argument("--ssl-keyfile-password", default=None,
                        help="the passphrase of an encrypted --ssl-keyfile (as uvicorn's; never asked on the terminal)")
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: the model's)")
    add_db_arg(parser)
    parser.add_argument("--no-record", action="store_true", help="do not record this server's turns")
    parser.add_argument("--in-process-engine", action="store_true",
                        help="run the engine in the HTTP server's process instead of its own engine-core process "
                             "(slower under load: both then share one GIL; for comparison)")
    parser.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                        help="uvicorn's log level (default warning)")
    add_engine_args(parser)


def _stop_on_sigterm(signum, frame):
    raise SystemExit(0)


def main(args: argparse.Namespace) -> int:
    # Lazy, the command boundary: the server and its engine side import torch (2 s niced on the
    # 2-core machine); `kvplay serve --help` and a bad flag answer without it.
    from kvplay.serve.core_proc import CoreParams, build_side
    from kvplay.serve.server import bind_socket, check_event_endpoints, identities_of, is_loopback, serve_forever, state_for

    if args.gen_curve_keys:
        d = wire_curve.generate(args.gen_curve_keys)
        print(f"kvplay: CURVE keys in {d}: serve with --kv-events-curve {d}; subscribers use "
              f"--events-curve-server-key {d}/server.key --events-curve-key {d}/client.key_secret "
              f"(allow more by adding their .key files to {d}/clients)")
        return 0
    if not 0 <= args.port <= 65535:
        raise KvplayError(f"--port must be 0..65535 (got {args.port})")
    if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
        raise KvplayError(f"--max-concurrent-requests must be at least 1 (got {args.max_concurrent_requests})")
    keys = load_keys(args.api_keys) if args.api_keys else None
    if keys is not None and args.isolation is None:
        args.isolation = "user"  # with keys, users do not share blocks unless the operator says so
    config = config_from_args(args)
    loopback = is_loopback(args.host)
    if keys is None and not loopback:
        raise KvplayError(f"--host {args.host}: without --api-keys kvplay serve listens on loopback only "
                          "(anyone could claim any user); give --api-keys FILE to serve other machines")
    if keys is None and args.explain_across_keys:
        raise KvplayError("--explain-across-keys goes with --api-keys: without keys every request has the same "
                          "keys, and there is nothing across them to explain")
    if keys is None and config.isolation != "shared":
        raise KvplayError(f"--isolation {config.isolation} needs --api-keys: without keys the user name comes "
                          "from the request body, and a salt the client picks isolates nothing")
    kv_cfg = KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None
    curve = wire_curve.ServerCurve.load(args.kv_events_curve) if args.kv_events_curve else None
    if curve is not None and (kv_cfg is None or not kv_cfg.enabled):
        raise KvplayError("--kv-events-curve needs --kv-events-config with enable_kv_cache_events")
    exposed = check_event_endpoints(kv_cfg, keys, loopback, curve, args.kv_events_insecure)
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise KvplayError("--ssl-keyfile and --ssl-certfile go together")
    if args.ssl_certfile:
        def no_prompt():  # an encrypted key without --ssl-keyfile-password: never ask the terminal
            raise KvplayError(f"--ssl-keyfile {args.ssl_keyfile} is encrypted: give --ssl-keyfile-password")

        try:  # before minutes of model loading
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
                args.ssl_certfile, args.ssl_keyfile, password=args.ssl_keyfile_password or no_prompt)
        except OSError as exc:
            raise KvplayError(f"--ssl-certfile/--ssl-keyfile: {exc.strerror or exc}") from None
    elif args.ssl_keyfile_password:
        raise KvplayError("--ssl-keyfile-password goes with --ssl-keyfile and --ssl-certfile")
    if not args.no_record:
        open_db(args.db).close()  # refuse a bad DB before spending time on the model
    sock = bind_socket(args.host, args.port)
    params = CoreParams(config, identities_of(keys), kv_cfg, loopback, args.kv_events_curve,
                        args.kv_cache_report_mode == "full", args.db, not args.no_record,
                        f"kvplay serve on {args.host}:{args.port}", args.explain_across_keys)
    local = None
    try:
        if args.in_process_engine:
            local = build_side(params)
            side = local[2]
        else:
            side = RemoteSide(params)
    except BaseException:
        sock.close()
        raise
    try:
        # uvicorn stops gracefully on SIGINT/SIGTERM, then re-raises the signal: make SIGTERM an
        # exception too (not the default instant exit), so the session is closed and the engine
        # stopped; set before the "serving" line, so a SIGTERM sent on seeing it is caught too
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
        state = state_for(side, keys, args.served_model_name, args.max_concurrent_requests, args.metrics_users)
        host = f"[{args.host}]" if ":" in args.host else args.host
        who = (f"{len(keys)} API keys ({', '.join(sorted({i.user for i in keys.values()}))})" if keys
               else "no API keys: user from the body's `user`")
        scheme = "https" if args.ssl_certfile else "http"
        print(inert(f"kvplay: serving {state.model_name} on {scheme}://{host}:{sock.getsockname()[1]}/v1 — {who}, "
                    f"isolation {config.isolation}", limit=None), file=sys.stderr, flush=True)  # names: serve/keys.py
        if keys is not None and config.isolation == "shared":
            print("kvplay: isolation shared: every key holder can tell from cached_tokens, cached_from and "
                  "time to first token whether another user sent a prompt (and who); use --isolation user to "
                  "stop it", file=sys.stderr, flush=True)
        elif keys is not None and args.explain_across_keys:
            print("kvplay: --explain-across-keys: explaining a miss walks other keys' identical prompts, and a key "
                  "holder can time that walk to tell whether another key sent the same prompt; leave it off where "
                  "the keys' holders do not trust each other", file=sys.stderr, flush=True)
        pub = side.events_info
        if pub is not None:
            print(f"kvplay: KV events {'bound on' if pub['binds'] else 'connecting to'} {pub['endpoint']}"
                  + (f", replay on {pub['replay_endpoint']}" if pub["replay_endpoint"] else "")
                  + (" (CURVE: allowed subscribers only)" if curve is not None else ""), file=sys.stderr, flush=True)
            if exposed:
                print(f"kvplay: --kv-events-insecure: {', '.join(exposed)} publish every user's prompts and replies "
                      "(token ids, user names) in clear to anyone who can reach them", file=sys.stderr, flush=True)
        if side.recording_info is not None:
            print(f"kvplay: recording session {side.recording_info['session_id']} in {side.recording_info['path']}",
                  file=sys.stderr, flush=True)
        gc.freeze()  # start-up's objects (torch, the tokenizer) are never garbage: keep the collector off them
        serve_forever(state, sock, args.log_level, args.ssl_keyfile, args.ssl_certfile, args.ssl_keyfile_password)
    finally:
        try:
            side.close()
        finally:
            sock.close()
            if local is not None:
                close_run(local[1], local[0])
    return 0
