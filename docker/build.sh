#!/usr/bin/env bash
# Build the CPU and GPU images from the repository root with podman or docker, whichever is installed.
#
#   docker/build.sh            # both images: token-pooling:cpu, then token-pooling:gpu
#   docker/build.sh gpu        # one of them
#
# Settings (environment variables; docker/README.md has the commands used on a proxied, registry-less host):
#   ENGINE               podman or docker (default: the first one found)
#   IMAGE                image name without the tag (default ghcr.io/token-pooling/token-pooling)
#   TORCH_INDEX_URL      torch's wheel index (default: each Dockerfile's; CPU: download.pytorch.org/whl/cpu,
#                        GPU: PyPI). https://pypi.org/simple works for both.
#   PIP_EXTRA_INDEX_URL  more wheel indexes for pip (a local mirror)
#   CA_BUNDLE            a PEM file of extra CA certificates, passed as the build secret `ca_bundle`
#   BUILD_NETWORK        the build's network mode (`host` reaches an index served on the host's loopback)
#   PULL                 podman's --pull policy (`never` with a base made by docker/base-image.sh)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
ENGINE=${ENGINE:-$(basename "$(command -v podman || command -v docker || echo none)")}
[ "$ENGINE" != none ] || { echo "build.sh: neither podman nor docker is installed" >&2; exit 2; }
IMAGE=${IMAGE:-ghcr.io/token-pooling/token-pooling}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/containers.conf}

args=()
[ -z "${TORCH_INDEX_URL:-}" ] || args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
[ -z "${PIP_EXTRA_INDEX_URL:-}" ] || args+=(--build-arg "PIP_EXTRA_INDEX_URL=$PIP_EXTRA_INDEX_URL")
if [ -n "${CA_BUNDLE:-}" ]; then
    [ -s "$CA_BUNDLE" ] || { echo "build.sh: CA_BUNDLE=$CA_BUNDLE is not a non-empty file" >&2; exit 2; }
    args+=(--secret "id=ca_bundle,src=$CA_BUNDLE")
fi
[ -z "${BUILD_NETWORK:-}" ] || args+=(--network "$BUILD_NETWORK")
if [ -n "${PULL:-}" ]; then
    # docker's --pull is a switch (always pull); podman's takes a policy
    [ "$(basename "$ENGINE")" = podman ] || { echo "build.sh: PULL is a podman setting" >&2; exit 2; }
    args+=(--pull="$PULL")
fi
if [ "$(basename "$ENGINE")" = docker ]; then
    export DOCKER_BUILDKIT=1   # build secrets and RUN --mount need BuildKit
fi

kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(cpu gpu)
for kind in "${kinds[@]}"; do
    [ -f "$here/Dockerfile.$kind" ] || { echo "build.sh: no docker/Dockerfile.$kind (cpu or gpu)" >&2; exit 2; }
    start=$(date +%s)
    "$ENGINE" build "${args[@]}" -f "$here/Dockerfile.$kind" -t "$IMAGE:$kind" "$root"
    size=$("$ENGINE" image inspect --format '{{.Size}}' "$IMAGE:$kind")
    echo "built $IMAGE:$kind in $(( $(date +%s) - start )) s, $(( size / 1000000 )) MB"
done
