"""Podman for the deploy tests: a Debian base image made from Debian's packages, the image
of deploy/Dockerfile built on it, and the stand-ins the compose file needs.

No image registry is reachable from the machines the tests run on, so nothing is pulled:

- the base image is a minimal Debian 12 made by ``mmdebstrap`` (what ``debian:bookworm-slim``
  is: the ``minbase`` variant, without manuals, docs and locales), imported into podman. On
  a machine whose HTTPS goes through an intercepting proxy, its CA certificates
  (``/usr/local/share/ca-certificates``) are copied in and pip is pointed at the system
  bundle (``PIP_CERT``), so that pip inside a build reaches PyPI as pip on the host does;
- deploy/Dockerfile is built as written, with two build arguments a user without
  PyTorch's index would give as well: ``BASE_IMAGE`` (that Debian) and a directory of
  wheels holding the machine's local CPU torch wheel (``--build-context wheels=DIR``,
  ``TORCH_INDEX_URL`` PyPI for torch's own dependencies);
- Redis and moto's S3 server for the compose file are built from ``images/`` here.

Everything lives in one podman storage of its own under the cache directory
(``$DEPLOY_TEST_CACHE``, default ``.deploy-cache/`` in the checkout, git-ignored): the base
tarball, the images and their layers. A second run rebuilds only the layers whose inputs
changed (a change of kvstore's code: its wheel, seconds). Delete the directory to start
over.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("DEPLOY_TEST_CACHE") or REPO / ".deploy-cache")
IMAGES = Path(__file__).resolve().parent / "images"
DOCKERFILE = REPO / "deploy" / "Dockerfile"

BASE_IMAGE = "localhost/kvstore-test/debian:bookworm"
SERVER_IMAGE = "localhost/kvstore-test/server:latest"
REDIS_IMAGE = "localhost/kvstore-test/redis:latest"
S3_IMAGE = "localhost/kvstore-test/moto:latest"

DEBIAN_MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
LOCAL_CA = Path("/usr/local/share/ca-certificates")
#: The image's Python (Debian 12's python3): the local torch wheel must be built for it.
IMAGE_PYTHON = ("3.11", "cp311")
#: Packages the tests need, as scripts/install-containers.sh installs them.
TOOLS = ("podman", "runc", "mmdebstrap", "podman-compose")


def missing_tools() -> list[str]:
    """What this machine lacks to run the container tests (empty: nothing)."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (podman's overlay storage and bridge networks need it)")
    return missing


def torch_version() -> str:
    """deploy/Dockerfile's default TORCH_VERSION."""
    match = re.search(r"^ARG TORCH_VERSION=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match is not None, "deploy/Dockerfile has no ARG TORCH_VERSION=..."
    return match.group(1)


class Podman:
    """``podman`` (and ``podman-compose``) on the tests' own storage and settings."""

    def __init__(self, cache: Path = CACHE) -> None:
        self.cache = cache
        cache.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "CONTAINERS_CONF": str(self._write_containers_conf()),
            "CONTAINERS_STORAGE_CONF": str(self._write_storage_conf()),
        }

    def _write_storage_conf(self) -> Path:
        path = self.cache / "storage.conf"
        path.write_text(
            "[storage]\n"
            'driver = "overlay"\n'
            f'graphroot = "{self.cache / "storage"}"\n'
            f'runroot = "{self.cache / "run"}"\n'
        )
        return path

    def _write_containers_conf(self) -> Path:
        # Containers get the limits this process has, never more: podman's defaults
        # (1048576 open files) fail where the machine withholds CAP_SYS_RESOURCE
        # ("crun: setrlimit `RLIMIT_NOFILE`: Operation not permitted"). runc, where
        # installed: crun refuses a host whose cgroup v2 hierarchy has controllers
        # beside v1 ("cgroups in hybrid mode not supported").
        nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 65536)
        nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
        lines = [
            "[containers]",
            f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]',
        ]
        if shutil.which("runc"):
            lines += ["[engine]", 'runtime = "runc"']
        path = self.cache / "containers.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def __call__(
        self, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run ``podman ARGS``; AssertionError with its output when it fails and ``check``."""
        return self.run(["podman", *args], timeout=timeout, check=check)

    def run(
        self,
        argv: Sequence[str],
        timeout: float = 600,
        check: bool = True,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command with podman's settings in its environment."""
        done = subprocess.run(
            list(argv),
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv[:4])} ... exited {done.returncode}:\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done

    def image_exists(self, name: str) -> bool:
        """True when the tests' storage holds the image ``name``."""
        return self("image", "exists", name, check=False).returncode == 0

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """One builder at a time (pytest-xdist workers, or two checkouts sharing a cache)."""
        with open(self.cache / "build.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def ensure_base(podman: Podman) -> str:
    """The Debian base image (made once, then kept in the cache); its name."""
    if podman.image_exists(BASE_IMAGE):
        return BASE_IMAGE
    tarball = podman.cache / "debian-bookworm.tar"
    cas = sorted(LOCAL_CA.glob("*.crt"))
    if not tarball.exists():
        hooks = []
        if cas:
            hooks = [
                f'--customize-hook=mkdir -p "$1{LOCAL_CA}" && cp {LOCAL_CA}/*.crt "$1{LOCAL_CA}/"'
            ]
        partial = tarball.with_suffix(".partial.tar")
        podman.run(
            [
                "mmdebstrap",
                "--variant=minbase",
                "--mode=root",
                "--format=tar",
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*",
                *hooks,
                "bookworm",
                str(partial),
                *DEBIAN_MIRRORS,
            ],
            timeout=900,
        )
        partial.rename(tarball)
    changes = ["--change", 'CMD ["bash"]']
    if cas:
        changes += ["--change", "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt"]
    podman("import", *changes, str(tarball), BASE_IMAGE, timeout=300)
    return BASE_IMAGE


def local_torch_wheels(podman: Podman) -> Path | None:
    """A directory holding this machine's CPU torch wheel for the image's Python (pip's
    own find-links, as scripts/setup.sh uses it), or None where there is none."""
    wheels = podman.cache / "wheels"
    version = torch_version()
    python, abi = IMAGE_PYTHON
    if any(wheels.glob(f"torch-{version}+cpu-{abi}-*.whl")):
        return wheels
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "-q", "--no-index", "--no-deps"),
            *("--only-binary=:all:", "--python-version", python, "--implementation", "cp"),
            *("--abi", abi, "--platform", "manylinux_2_28_x86_64", "-d", str(wheels)),
            f"torch=={version}+cpu",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return wheels if done.returncode == 0 else None


def build_server_image(podman: Podman) -> str:
    """deploy/Dockerfile, built from the root of this checkout; the image's name."""
    base = ensure_base(podman)
    args = ["--build-arg", f"BASE_IMAGE={base}"]
    wheels = local_torch_wheels(podman)
    if wheels is not None:
        # PyPI has no "+cpu" build of torch: torch comes from the wheel, its dependencies
        # (sympy, networkx, ...) from PyPI.
        args += ["--build-context", f"wheels={wheels}"]
        args += ["--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple"]
    build(podman, DOCKERFILE, REPO, SERVER_IMAGE, *args)
    return SERVER_IMAGE


def build_standins(podman: Podman) -> tuple[str, str]:
    """The Redis and S3 (moto) images the compose file is given in place of Docker Hub's."""
    base = ensure_base(podman)
    build(
        podman,
        IMAGES / "redis.Containerfile",
        IMAGES,
        REDIS_IMAGE,
        f"--build-arg=BASE_IMAGE={base}",
    )
    moto = f"--build-arg=KVSTORE_IMAGE={SERVER_IMAGE}"
    build(podman, IMAGES / "moto.Containerfile", IMAGES, S3_IMAGE, moto)
    return REDIS_IMAGE, S3_IMAGE


def build(podman: Podman, containerfile: Path, context: Path, tag: str, *args: str) -> float:
    """``podman build`` (Docker's image format: it keeps HEALTHCHECK); seconds it took."""
    start = time.monotonic()
    podman(
        "build",
        "--format=docker",
        "--layers",
        "-f",
        str(containerfile),
        "-t",
        tag,
        *args,
        str(context),
        timeout=1800,
    )
    return time.monotonic() - start
