"""Subcommands of the `slidedp` CLI; each module has register(subparsers) and a handler."""
