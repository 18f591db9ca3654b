"""The subcommands of `kvplay`, one module each, named for the command (`import` is `import_`).

Each module has `configure(parser)` and `main(args) -> int`: it parses and checks its arguments
and calls into the layers below (engine … bench); kvplay/cli.py lists them in COMMANDS and
imports only the one asked for, so `kvplay --help` stays fast. A module imports at its top what
its parser and its run need, except what imports torch (the engine, the simulator, the server):
that it imports in its run, after the arguments are checked, with the measured cost beside it, so
`kvplay CMD --help` and a bad flag answer at once (tests/cli/test_startup.py lists those imports).
"""
