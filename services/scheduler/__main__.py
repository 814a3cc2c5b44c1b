"""`python -m services.scheduler`: runs the scheduler as its own process."""

from services.scheduler.service import main
from taskgate.config import SchedulerSettings
from taskgate.runtime import run_service

if __name__ == "__main__":
    run_service("scheduler", SchedulerSettings, main, lambda s: s.scheduler_metrics_port)
