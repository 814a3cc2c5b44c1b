"""`python -m services.worker`: a worker as its own process."""

from services.worker.service import main
from taskgate.config import WorkerSettings
from taskgate.runtime import run_service

if __name__ == "__main__":
    run_service("worker", WorkerSettings, main, lambda s: s.worker_metrics_port)
