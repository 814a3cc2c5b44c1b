"""`python -m services.notifier`: the notifier as its own process."""

from services.notifier.service import main
from taskgate.config import NotifierSettings
from taskgate.runtime import run_service

if __name__ == "__main__":
    run_service("notifier", NotifierSettings, main, lambda s: s.notifier_metrics_port)
