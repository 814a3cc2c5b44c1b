"""`python -m taskgate_client.cli`: the `taskgate` command."""

import sys

from taskgate_client.cli.main import main

sys.exit(main())
