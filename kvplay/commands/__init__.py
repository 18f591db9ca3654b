"""The `kvplay` subcommands, one module each (configure(parser), main(args)); the logic they
drive lives in the layers below (sessions/, serve/, tui/, ...)."""
