"""One module per `moet` subcommand; each defines `register(subparsers)` and sets `func`."""
