"""`python -m services.http`: the HTTP/JSON API and the dashboard as their own process."""

from services.http.service import main
from taskgate.config import HttpSettings
from taskgate.runtime import run_service

if __name__ == "__main__":
    run_service("http", HttpSettings, main, lambda s: s.http_metrics_port)
