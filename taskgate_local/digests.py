"""`make pin-digests`: every third-party image the Dockerfile, compose.yaml and deploy/ name, pinned as
`name:tag@sha256:...`.

The tag says what the image is; the digest is what is pulled, so a re-pushed tag cannot change an image under a
manifest. This asks a registry for each tag's current digest (skopeo, crane or `docker buildx imagetools`, whichever is
here) and rewrites the references whose digest moved; `--check` only lists what is not pinned
(tests/system/test_images.py runs that check offline). taskgate's own images (taskgate-api, taskgate, taskgate-cuda) are
not here: the release pins them with kustomize's `images:` (`digest:`), as deploy/README.md says.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OWN = ("taskgate-api", "taskgate", "taskgate-cuda")
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
# `image:` / `imageName:` values in YAML (compose's `${VAR:-default}` keeps the default), the Dockerfile's ARG *_IMAGE
# defaults and FROM lines that name an image rather than a stage or an argument
PATTERNS = {
    "yaml": re.compile(r"^\s*(?:-\s+)?(?:image|imageName):\s*[\"']?(?:\$\{\w+:-)?(?P<ref>[^\s\"'}]+)", re.M),
    "dockerfile": re.compile(r"^(?:ARG\s+\w*IMAGE=|FROM\s+)(?P<ref>[^\s$]+)", re.M),
}


@dataclass(frozen=True)
class Reference:
    """One image reference in one file."""

    path: Path
    ref: str

    @property
    def tagged(self) -> str:
        """The reference without its digest: what the registry is asked about."""
        return DIGEST.sub("", self.ref)

    @property
    def pinned(self) -> bool:
        return DIGEST.search(self.ref) is not None and ":" in self.tagged.rsplit("/", 1)[-1]


def files() -> list[Path]:
    """The files that name images: the Dockerfile, compose.yaml and every YAML file under deploy/."""
    return [ROOT / "Dockerfile", ROOT / "compose.yaml", *sorted((ROOT / "deploy").rglob("*.yaml"))]


def references() -> list[Reference]:
    """Every third-party image reference (taskgate's own images and Dockerfile stages left out)."""
    found = []
    for path in files():
        text = path.read_text()
        kind = "dockerfile" if path.name == "Dockerfile" else "yaml"
        stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M | re.I))
        for match in PATTERNS[kind].finditer(text):
            ref = match.group("ref")
            if ref in stages or ref.rsplit("/", 1)[-1].split(":")[0].split("@")[0] in OWN:
                continue
            found.append(Reference(path, ref))
    return found


def resolver() -> list[str] | None:
    """A command that prints a reference's digest (the reference appended), or None when no tool is here."""
    if shutil.which("skopeo"):
        # the top-level manifest (the multi-platform index): its sha256 is the digest
        return ["skopeo", "inspect", "--raw"]
    if shutil.which("crane"):
        return ["crane", "digest"]
    if shutil.which("docker") and subprocess.run(["docker", "buildx", "version"], capture_output=True).returncode == 0:
        return ["docker", "buildx", "imagetools", "inspect", "--format", "{{json .Manifest.Digest}}"]
    return None


def resolve(command: list[str], tagged: str) -> str:
    """The registry's digest for a tag (of the multi-platform index where there is one)."""
    target = f"docker://{tagged}" if command[0] == "skopeo" else tagged
    done = subprocess.run([*command, target], capture_output=True, timeout=120)
    if done.returncode != 0:
        error = done.stderr.decode(errors="replace").strip()
        raise RuntimeError(error.splitlines()[-1] if error else f"exit {done.returncode}")
    digest = (
        f"sha256:{hashlib.sha256(done.stdout).hexdigest()}"
        if command[0] == "skopeo"
        else done.stdout.decode().strip().strip('"')
    )
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise RuntimeError(f"not a digest: {digest!r}")
    return digest


def main(argv: list[str] | None = None) -> int:
    """Entry point of `make pin-digests`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only list references without a digest (exit 1 if any)")
    options = parser.parse_args(argv)
    refs = references()
    if options.check:
        loose = [r for r in refs if not r.pinned]
        for ref in loose:
            print(f"{ref.path.relative_to(ROOT)}: {ref.ref} is not pinned by digest")
        return 1 if loose else 0
    command = resolver()
    if command is None:
        print("pin-digests: no skopeo, crane or docker buildx here (apt-get install skopeo)", file=sys.stderr)
        return 3
    failed = 0
    for tagged in sorted({r.tagged for r in refs}):
        try:
            digest = resolve(command, tagged)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"pin-digests: {tagged}: {exc}", file=sys.stderr)
            failed += 1
            continue
        for ref in [r for r in refs if r.tagged == tagged and r.ref != f"{tagged}@{digest}"]:
            ref.path.write_text(ref.path.read_text().replace(ref.ref, f"{tagged}@{digest}"))
            print(f"{ref.path.relative_to(ROOT)}: {ref.ref} -> {tagged}@{digest}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
