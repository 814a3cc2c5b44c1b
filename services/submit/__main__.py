"""`python -m services.submit`: the TaskGateway service as its own process."""

from services.submit.service import main
from taskgate.config import GatewaySettings
from taskgate.runtime import run_service

if __name__ == "__main__":
    run_service("submit", GatewaySettings, main, lambda s: s.submit_metrics_port)
