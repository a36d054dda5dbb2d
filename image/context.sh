#!/bin/sh
# Fills the image's build context (Containerfile) on the host, so that nothing is fetched inside the build:
#   wheels/           torch's CPU wheel and every dependency of kvserve, as wheels
#   requirements.txt  each of them pinned by version and sha256 (image/requirements.py): the dependency layer's
#                     cache key, so that a change to kvserve's own code does not reinstall them
#   kvserve/          kvserve's own wheel, built reproducibly (SOURCE_DATE_EPOCH): the same sources give the
#                     same bytes, and so a cached layer
#   model/            the default model as `kvserve model prepare` converted it on this host
# Usage: image/context.sh PYTHON DIR [EXTRA]
#   EXTRA  one of kvserve's extras to install with it: `gpu` for Containerfile.cuda, where pip's index resolves
#          torch==2.13.0 to a CUDA wheel (PyPI's default on Linux x86_64)
set -eu
py=$1
out=$2
spec=.${3:+[$3]}
rm -rf "$out"
mkdir -p "$out/wheels" "$out/kvserve"
SOURCE_DATE_EPOCH=315532800 $py -m pip wheel -q -w "$out/wheels" "$spec" torch==2.13.0
mv "$out"/wheels/kvserve-*.whl "$out/kvserve/"
# redis' dependency on Pythons before 3.11.3, such as Debian bookworm's 3.11.2 (the local base)
$py -m pip download -q --no-deps 'async-timeout>=4.0.3' -d "$out/wheels"
$py image/requirements.py "$out/wheels" >"$out/requirements.txt"
model=$("$(dirname "$py")/kvserve" model prepare)  # the folder it converted into (once)
cp -al "$model" "$out/model" 2>/dev/null || cp -a "$model" "$out/model"
