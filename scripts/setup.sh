#!/usr/bin/env bash
# Installs everything ipward needs on a fresh Debian bookworm machine: system packages,
# a virtualenv on Debian's /usr/bin/python3 (the interpreter the CNI plugin runs under),
# both distributions editable: the product `ipward` (root pyproject.toml, with its test
# extras) and the labs `ipward-lab` (lab/pyproject.toml: demo, sim, bench, test servers),
# and the native plugin (src/ipward/cni/native: musl-gcc; clang and its sanitizer
# runtimes fuzz it in the tests). Safe to run again; skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(etcd-server etcd-client containernetworking-plugins iproute2 iputils-ping python3-venv
  containerd runc gcc libc6-dev faketime musl-tools clang libclang-rt-14-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  as_root=()
  [ "$(id -u)" -eq 0 ] || as_root=(sudo)
  "${as_root[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  /usr/bin/python3 -m venv .venv
fi
stamp=.venv/.ipward-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ lab/pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -e '.[test]' -e ./lab
  touch "$stamp"
fi

native=src/ipward/cni/native
if [ ! -f "$native/ipward-cni" ] || [ "$native/ipward-cni.c" -nt "$native/ipward-cni" ] \
  || [ "$native/build.sh" -nt "$native/ipward-cni" ]; then
  "$native/build.sh"
fi
