"""The one place taskgate's version is written: the three distributions (taskgate, taskgate-client, taskgate-api),
`taskgate --version`, the SDK's user agent, every service's taskgate_build_info metric and its traces' service.version
read it from here."""

__version__ = "0.1.0"
