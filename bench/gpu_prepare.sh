#!/usr/bin/env bash
# Makes the carry folder for the GPU run, on this machine (the GPU machine has no network):
#
#   bash bench/gpu_prepare.sh          # then: the device tool's run, carry [".gpu_carry"], command `bash bench/gpu_run.sh`
#
# 1. downloads, one `pip download --no-deps` per pin of bench/gpu_requirements.txt (nothing resolves further, so no
#    pin can pull torch, triton or a CUDA library), wheels for CPython 3.12 / manylinux x86-64 (the GPU image's
#    Python 3.12.3 on x86-64) into .gpu_carry/ (git-ignored), from $GPU_PREPARE_INDEX (default PyPI);
# 2. builds the project's own wheel from this tree into it, and records the commit and tree state in
#    .gpu_carry/SOURCE (bench/gpu_run.sh warns when the tree it runs from differs);
# 3. refuses any wheel that would replace the image's torch, triton, nvidia-* or cuda-* packages;
# 4. checks that the carry folder plus every file that travels (tracked and untracked-not-ignored) stays under
#    $GPU_PREPARE_MAX_MIB (default 48: the tool's limit is 64 MiB, the rest is margin for results and edits);
# 5. prints the `carry` list to name in the run call.
# Time: about a minute (downloads of ~20 MB, one wheel build); each download is capped at 300 s (a hung index must
# not hold the session).
set -euo pipefail
cd "$(dirname "$0")/.."

CARRY=${GPU_CARRY:-.gpu_carry}
INDEX=${GPU_PREPARE_INDEX:-https://pypi.org/simple}
MAX_MIB=${GPU_PREPARE_MAX_MIB:-48}
REQS=${GPU_REQUIREMENTS:-bench/gpu_requirements.txt}
PLATFORMS=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
           --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
REFUSED='^(torch|triton|nvidia[-_].*|cuda[-_].*|torchvision|torchaudio|pytorch[-_]triton)$'

pins=$(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$REQS" | grep .)
for pin in $pins; do  # checked before anything is fetched
    name=${pin%%==*}
    if [[ "$pin" != *==* ]]; then echo "gpu_prepare: $pin is not pinned (name==version)" >&2; exit 1; fi
    if [[ "$(echo "$name" | tr 'A-Z_.' 'a-z--')" =~ $REFUSED ]]; then
        echo "gpu_prepare: refusing $pin: it would replace the GPU image's own $name" >&2; exit 1
    fi
done
git check-ignore -q "$CARRY/x" || { echo "gpu_prepare: $CARRY is not git-ignored (.gitignore)" >&2; exit 1; }
rm -rf "$CARRY" && mkdir -p "$CARRY"
for pin in $pins; do
    timeout 300 python3 -m pip download -q --no-deps --only-binary=:all: "${PLATFORMS[@]}" \
        --index-url "$INDEX" -d "$CARRY" "$pin"
done

# The project itself (its dependencies are the image's or pinned above: --no-deps).
timeout 300 python3 -m pip wheel -q --no-deps --index-url "$INDEX" -w "$CARRY" .
{
    echo "commit $(git rev-parse HEAD)"
    echo "tree $( (git diff HEAD; git ls-files --others --exclude-standard) | sha256sum | cut -c1-16)"
    echo "made $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} > "$CARRY/SOURCE"

# Nothing may replace the image's torch / triton / CUDA libraries, whatever the pins said.
for whl in "$CARRY"/*.whl; do
    dist=$(basename "$whl" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
    if [[ "$dist" =~ $REFUSED ]]; then echo "gpu_prepare: refusing $(basename "$whl")" >&2; rm -f "$whl"; exit 1; fi
done
# One version of each distribution (two stop the whole offline install).
dups=$(ls "$CARRY"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z_.' 'a-z--' | sort | uniq -d)
if [ -n "$dups" ]; then echo "gpu_prepare: two wheels of: $dups" >&2; exit 1; fi

carry_b=$(du -sb "$CARRY" | cut -f1)
tree_b=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
total_mib=$(( (carry_b + tree_b) / 1048576 ))
ls -l "$CARRY"
echo "gpu_prepare: carry $((carry_b / 1048576)) MiB + travelling tree $((tree_b / 1048576)) MiB = $total_mib MiB" \
     "(limit ${MAX_MIB} MiB here, 64 MiB in the tool)"
if [ "$total_mib" -ge "$MAX_MIB" ]; then echo "gpu_prepare: too large" >&2; exit 1; fi
echo "carry: [\"$CARRY\"]"
