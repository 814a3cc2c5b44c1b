# syntax=docker/dockerfile:1.7
# taskgate's images, built from this repository's distributions (.: taskgate; clients/*: taskgate-client, ...) on top of
# the hash-locked dependencies of requirements/ (`make lock` writes them from constraints.txt and the pyprojects).
# Every dependency is installed with `pip install --require-hashes --no-deps -r requirements/<file>.txt`, the project's
# own wheels (built here from the checkout) with --no-deps, and `pip check` proves the set complete: nothing enters an
# image that requirements/ does not name with its hash. The dependency layers come before the project's code, so that a
# code change rebuilds only the last layer. The Kubernetes manifests choose the process with `command`:
#   python -m services.submit | services.notifier | services.scheduler | services.worker | taskgate.migrate
# Three targets, which are also the image names deploy/k8s uses (tests/system/test_deploy.py checks that):
#   docker build --target taskgate-api  -t taskgate-api:dev .   # no torch: submit, notifier, scheduler, migrations
#   docker build --target taskgate      -t taskgate:dev .       # CPU torch: dev/CPU workers (and the dev tiny model)
#   docker build --target taskgate-cuda -t taskgate-cuda:dev .  # CUDA torch: GPU workers (prod overlay)
# `make images` builds them with podman, buildah or docker. Build arguments for machines without these defaults' internet:
#   PYTHON_IMAGE          a base with Python 3.11 on Debian bookworm (scripts/container_host.sh makes one offline)
#   TORCH_INDEX_URL       where the CPU torch wheel comes from (default PyTorch's CPU index)
#   TORCH_CUDA_INDEX_URL  where the CUDA torch wheel comes from (default PyPI)
#   LOCAL_WHEELS          a wheel folder pip also looks in (--find-links), mounted into the build (podman build -v D:D:ro);
#                         its files must still match requirements/'s hashes

# The official image by digest (docker-library/repo-info, repos/python/remote/3.11-slim-bookworm.md at 33a22f41: the
# multi-platform index of 2026-08-25, Python 3.11.16); `make pin-digests` moves it to the tag's current digest.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b

# The project's wheels, built with the locked setuptools and no build isolation (which would fetch an unhashed one).
FROM ${PYTHON_IMAGE} AS wheels
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/build
COPY requirements/build.txt /tmp/requirements/
RUN /opt/build/bin/pip install --require-hashes --no-deps -r /tmp/requirements/build.txt
WORKDIR /src
COPY pyproject.toml constraints.txt ./
COPY clients/ clients/
COPY taskgate/ taskgate/
COPY taskgate_api/ taskgate_api/
COPY taskgate_client/ taskgate_client/
COPY taskgate_local/ taskgate_local/
COPY services/ services/
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation -w /wheels ./clients/*/ .

# The API services: the distributions' runtime dependencies only (no torch, diffusers or embedded servers).
FROM ${PYTHON_IMAGE} AS deps-api
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY requirements/api.txt /tmp/requirements/
RUN pip install --require-hashes --no-deps -r /tmp/requirements/api.txt
COPY --from=wheels /wheels /wheels
RUN pip install --no-deps /wheels/*.whl && pip check

# CPU torch comes from PyTorch's CPU index: PyPI's Linux torch wheel is the CUDA build and pulls ~3 GB of
# nvidia-* libraries that a CPU pod never uses. worker.txt was resolved against the CPU build: no CUDA library in it.
FROM ${PYTHON_IMAGE} AS deps-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG LOCAL_WHEELS=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY requirements/torch-cpu.txt /tmp/requirements/
RUN pip install --require-hashes --no-deps --index-url "$TORCH_INDEX_URL" ${LOCAL_WHEELS:+--find-links "$LOCAL_WHEELS"} \
        -r /tmp/requirements/torch-cpu.txt
COPY requirements/worker.txt /tmp/requirements/
RUN pip install --require-hashes --no-deps -r /tmp/requirements/worker.txt
COPY --from=wheels /wheels /wheels
RUN pip install --no-deps /wheels/*.whl && pip check

# CUDA torch: the PyPI wheel bundles the CUDA runtime, cuDNN and NCCL as nvidia-* wheels, so a plain Python base is
# enough; the node provides only the driver (NVIDIA container toolkit / device plugin). A base such as
# nvidia/cuda:12.x-cudnn-runtime would only be needed for extensions compiled against the system CUDA toolkit.
FROM ${PYTHON_IMAGE} AS deps-cuda
ARG TORCH_CUDA_INDEX_URL=https://pypi.org/simple
ARG LOCAL_WHEELS=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY requirements/torch-cuda.txt /tmp/requirements/
RUN pip install --require-hashes --no-deps --index-url "$TORCH_CUDA_INDEX_URL" ${LOCAL_WHEELS:+--find-links "$LOCAL_WHEELS"} \
        -r /tmp/requirements/torch-cuda.txt
COPY requirements/worker.txt /tmp/requirements/
RUN pip install --require-hashes --no-deps -r /tmp/requirements/worker.txt
COPY --from=wheels /wheels /wheels
RUN pip install --no-deps /wheels/*.whl && pip check

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 taskgate \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin taskgate \
    && install -d -o 10001 -g 10001 /var/lib/taskgate
# HOME and the Hugging Face cache point at /tmp (an emptyDir in the pods); models are loaded from local folders only.
# pip compiled the installed code already: the root filesystem is read-only at run time.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface \
    HF_HUB_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    TASKGATE_STATE_DIR=/var/lib/taskgate \
    TASKGATE_GRPC_HOST=0.0.0.0 \
    TASKGATE_METRICS_HOST=0.0.0.0
WORKDIR /var/lib/taskgate
USER 10001:10001
EXPOSE 50051 50052 50053 50054 9101 9102 9103 9104
CMD ["python", "-m", "services.submit"]

FROM runtime AS taskgate-api
COPY --from=deps-api /opt/venv /opt/venv

FROM runtime AS taskgate
COPY --from=deps-cpu /opt/venv /opt/venv

FROM runtime AS taskgate-cuda
COPY --from=deps-cuda /opt/venv /opt/venv
