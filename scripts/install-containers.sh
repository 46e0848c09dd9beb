#!/usr/bin/env bash
# Install what the container tests of tests/deploy need, from Debian's packages: podman
# (with runc, netavark, aardvark-dns and iptables for its networks), podman-compose, and
# mmdebstrap, which makes the tests' Debian base image (no image registry is reachable).
# A no-op when present. scripts/test-deploy.sh runs it.
set -euo pipefail
packages=(podman runc netavark aardvark-dns iptables podman-compose mmdebstrap)
if dpkg -s "${packages[@]}" >/dev/null 2>&1; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install-containers: installing ${packages[*]} with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >&2
$sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >&2
