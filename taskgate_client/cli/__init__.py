"""`taskgate`: submit, follow and manage tasks from a shell; defaults to the stack `make run` started.

The command's parts: `output` (what it prints), `config` (where it connects), `tasks` and `admin` (the commands),
`parser` (the command line) and `main` (the entry point). The exit codes, a contract for scripts, are
taskgate_api.cli's (shared with `taskgate-keys`); `admin requeue` adds EXIT_SKIPPED.
"""

from taskgate_api.cli import EXIT_BY_CODE, EXIT_BY_STATUS
from taskgate_client.cli.admin import EXIT_SKIPPED
from taskgate_client.cli.main import main
from taskgate_client.cli.parser import build_parser

__all__ = ["EXIT_BY_CODE", "EXIT_BY_STATUS", "EXIT_SKIPPED", "build_parser", "main"]
