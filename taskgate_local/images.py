"""`make images`: builds taskgate's images from the Dockerfile with podman, buildah or docker (whichever works here).

scripts/container_host.sh prepares the machine first (an engine; without a registry, a local base image and stand-ins
for postgres and nats). The Dockerfile's defaults suit a machine with internet; here they become build arguments:
PYTHON_IMAGE (default: the official base when it can be pulled, else the local one), TORCH_INDEX_URL and LOCAL_WHEELS
(default: a folder of pip's own --find-links configuration that holds the pinned CPU torch wheel, used with PyPI). The
CUDA image is built only when asked (--cuda, or `make images CUDA=1`): its torch pulls ~2.7 GB of nvidia wheels.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCAL_BASE = "localhost/taskgate-base:bookworm"
DOCKERFILE = ROOT / "Dockerfile"
# the Dockerfile's default base, pinned by digest there: the one place that names it (an installed wheel has no
# Dockerfile)
_BASE = re.search(r"^ARG PYTHON_IMAGE=(\S+)", DOCKERFILE.read_text() if DOCKERFILE.exists() else "", re.M)
OFFICIAL_BASE = _BASE.group(1) if _BASE else "python:3.11-slim-bookworm"
CPU_TARGETS = ("taskgate-api", "taskgate")
CUDA_TARGET = "taskgate-cuda"
# the images compose.yaml and the image test run: the postgres and nats stand-ins made where no registry answers
STANDINS = {"postgres": "localhost/postgres:15", "nats": "localhost/nats:2"}
# heavy work runs on idle CPU only: the machines that build images also run test suites
NICE = ["nice", "-n", "19", "ionice", "-c3"]


def engine() -> str | None:
    """The engine that runs containers here: podman, else docker with a running daemon; None when neither answers."""
    for name in ("podman", "docker"):
        if shutil.which(name) and subprocess.run([name, "info"], capture_output=True).returncode == 0:
            return name
    return None


def image_exists(tool: str, image: str) -> bool:
    """Whether `image` is in the engine's local storage."""
    args = {"podman": ["image", "exists", image], "buildah": ["inspect", "--type", "image", image]}.get(
        tool, ["image", "inspect", image]
    )
    return subprocess.run([tool, *args], capture_output=True).returncode == 0


def torch_pin() -> str:
    """The torch version constraints.txt pins."""
    found = re.search(r"^torch==([\w.]+)", (ROOT / "constraints.txt").read_text(), re.M)
    if found is None:
        raise SystemExit("constraints.txt pins no torch")
    return found.group(1)


def local_wheels() -> Path | None:
    """A folder of pip's --find-links (environment or configuration) holding the pinned CPU torch wheel, if any."""
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    folders += [
        value for key, value in re.findall(r"^(\S*find-links)='([^']*)'", listed, re.M) for value in value.split()
    ]
    for folder in map(Path, folders):
        if folder.is_dir() and any(folder.glob(f"torch-{torch_pin()}+cpu-*.whl")):
            return folder
    return None


def build_args(tool: str) -> tuple[dict[str, str], list[str]]:
    """The build arguments and extra engine options for this machine (explicit environment variables win)."""
    args: dict[str, str] = {}
    options: list[str] = []
    base = os.environ.get("PYTHON_IMAGE") or (OFFICIAL_BASE if image_exists(tool, OFFICIAL_BASE) else LOCAL_BASE)
    if base != OFFICIAL_BASE:
        args["PYTHON_IMAGE"] = base
    wheels = Path(os.environ["LOCAL_WHEELS"]) if os.environ.get("LOCAL_WHEELS") else local_wheels()
    if wheels is not None:
        if tool == "docker":
            raise SystemExit(
                f"LOCAL_WHEELS={wheels}: docker build cannot mount a folder; use podman or buildah, or unset it"
            )
        args["LOCAL_WHEELS"] = str(wheels)
        # the local wheel beside PyPI (for torch's own dependencies); PyTorch's index may not be reachable here
        args["TORCH_INDEX_URL"] = "https://pypi.org/simple"
        options += ["-v", f"{wheels}:{wheels}:ro"]
    for name in ("TORCH_INDEX_URL", "TORCH_CUDA_INDEX_URL"):
        if os.environ.get(name):
            args[name] = os.environ[name]
    return args, options


def build(tool: str, target: str, tag: str, args: dict[str, str], options: list[str]) -> float:
    """Builds one Dockerfile target as `target:tag`; returns the seconds it took."""
    command = [tool, "build"] if tool != "buildah" else [tool, "bud"]
    # host networking: bridge networks need private address ranges some machines refuse; a build needs only egress
    command += [
        "--network",
        "host",
        "-f",
        str(ROOT / "Dockerfile"),
        "--target",
        target,
        "-t",
        f"{target}:{tag}",
        *options,
    ]
    for name, value in args.items():
        command += ["--build-arg", f"{name}={value}"]
    print("+", " ".join(command), flush=True)
    started = time.monotonic()
    subprocess.run([*NICE, *command, str(ROOT)], check=True)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    """Entry point of `make images`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tag", default=os.environ.get("IMAGE_TAG") or "dev", help="tag of the built images (default dev)"
    )
    parser.add_argument(
        "--cuda", action="store_true", default=bool(os.environ.get("CUDA")), help="also build taskgate-cuda"
    )
    parser.add_argument(
        "--target", action="append", choices=[*CPU_TARGETS, CUDA_TARGET], help="build only these targets"
    )
    options = parser.parse_args(argv)
    prepared = subprocess.run([str(ROOT / "scripts" / "container_host.sh")], stdout=subprocess.PIPE, text=True)
    if prepared.returncode != 0:
        return prepared.returncode
    tool = prepared.stdout.strip() or engine()
    if tool is None:
        print("images: no container engine", file=sys.stderr)
        return 3
    targets = options.target or [*CPU_TARGETS, *([CUDA_TARGET] if options.cuda else [])]
    args, extra = build_args(tool)
    for target in targets:
        seconds = build(tool, target, options.tag, args, extra)
        print(f"images: {target}:{options.tag} built in {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
