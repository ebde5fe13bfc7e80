#!/usr/bin/env bash
# Put a device call's knee folder where the next call can resume it, fast (a warm machine waits ~30 s):
#   bash bench/knee_carry.sh NAME [FILES_DIR]
# unpacks FILES_DIR/knee.tgz (the knee step's archive; FILES_DIR defaults to the newest folder under
# $DEVICE_FILES, /work/.device, where the device tool puts a call's files) into bench/results/tmp/NAME
# (git-ignored) and prints what the next call needs: RESUME=bench/results/tmp/NAME and that path in its carry.
set -euo pipefail
name=${1:?usage: bash bench/knee_carry.sh NAME [FILES_DIR]}
src=${2:-$(ls -td "${DEVICE_FILES:-/work/.device}"/*/ 2>/dev/null | head -1)}
[ -f "$src/knee.tgz" ] || { echo "no knee.tgz in '${src}'" >&2; exit 2; }
cd "$(dirname "$0")/.."
dst=bench/results/tmp/$name
mkdir -p bench/results/tmp
tmp=$(mktemp -d bench/results/tmp/.unpack.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
tar xzf "$src/knee.tgz" -C "$tmp"
[ -f "$tmp/knee/knee.json" ] || { echo "$src/knee.tgz holds no knee/knee.json" >&2; exit 2; }
rm -rf "$dst" && mv "$tmp/knee" "$dst"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('stopped:', d.get('stopped'), '| calls:', len(d.get('calls', [])))" "$dst/knee.json"
echo "RESUME=$dst   carry: [\".whl-slim\", \"$dst\"]"
