"""The subcommands of `kvplay`, one module each, named for the command (`import` is `import_`).

Each module has `configure(parser)` and `main(args) -> int`: it parses and checks its arguments
and calls into the layers below (engine … bench); kvplay/cli.py lists them in COMMANDS and
imports only the one asked for, so `kvplay --help` stays fast.
"""
