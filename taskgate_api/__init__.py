"""What a taskgate server and its clients share (the taskgate-api distribution), and nothing else:

- `taskgate_api.v1`: the generated gRPC code and typed stubs of the taskgate.v1 API (`make proto`);
- `taskgate_api.status.Status`: a task's state as the wire names it;
- `taskgate_api.reasons`: the ErrorInfo reason codes errors carry, and their domain;
- `taskgate_api.webhook_signing`: Standard Webhooks signatures (the notifier signs, receivers verify);
- `taskgate_api.cli`: the command-line contract the `taskgate` and `taskgate-keys` commands both keep;
- `__version__`: the one version of the three distributions.

It imports neither the server (`taskgate`) nor the client (`taskgate_client`); both import it.
"""

from taskgate_api.version import __version__

__all__ = ["__version__"]
