"""CLI subcommands, one module each."""
