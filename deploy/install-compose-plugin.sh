#!/bin/sh
# Install the `docker compose` CLI plugin from Debian's docker-compose package (2.x, in trixie; the
# bookworm package is the old Python docker-compose 1.29) without touching the system's apt setup:
# a private source list and cache in a temporary folder, `apt-get download`, and the binary copied
# to $DOCKER_CONFIG/cli-plugins (default ~/.docker/cli-plugins), where the docker CLI looks for it.
# Used to validate docker-compose.yml (`docker compose config`, tests/stack/test_compose.py).
set -eu
dest="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
  > "$tmp/sources.list"
apt_opts="-o Dir::Etc::SourceList=$tmp/sources.list -o Dir::Etc::SourceParts=/dev/null
  -o Dir::State::Lists=$tmp/lists -o Dir::Cache=$tmp/cache -o APT::Get::List-Cleanup=0 -o APT::Sandbox::User=root -qq"
# shellcheck disable=SC2086
apt-get $apt_opts update
cd "$tmp"
# shellcheck disable=SC2086
apt-get $apt_opts download docker-compose
dpkg-deb -x docker-compose_*.deb root
mkdir -p "$dest"
cp root/usr/libexec/docker/cli-plugins/docker-compose "$dest/"
docker compose version
