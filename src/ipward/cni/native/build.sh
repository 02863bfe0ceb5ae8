#!/bin/sh
# Builds the node's CNI plugin (ipward-cni.c) into one statically linked executable
# that needs nothing of the host: musl's C library linked in (Debian's musl-tools),
# written beside its target and renamed over it. Run by scripts/setup.sh (a checkout)
# and by the Containerfile's build stage (the image).
#
#   build.sh [OUTPUT]        default: ipward-cni beside this script
set -eu
here=$(dirname "$0")
out=${1:-$here/ipward-cni}
musl-gcc -static -O2 -std=c11 -Wall -Wextra -Werror -s -o "$out.partial" "$here/ipward-cni.c" -lm
mv "$out.partial" "$out"
