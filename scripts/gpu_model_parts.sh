#!/bin/sh
# A packaged model, quantized, in parts a device call can carry (docs/GPU.md).
#
#   sh scripts/gpu_model_parts.sh [NAME] [BITS]     (default: smollm2-135m 4)
#
# Writes .gpu/model/m1, m2, ...: one 46 MB part of the model directory's tar
# each (a call carries 64 MiB at most). On the device, one call per part,
# within the ~30 s the machine stays warm, copies it to /root/mparts; the
# last then runs `sh scripts/gpu_run.sh ensure model ...`, which assembles
# /root/model for `gpu_split.py --model /root/model`.
set -eu
name=${1:-smollm2-135m}
bits=${2:-4}
py=${PYTHON:-.venv/bin/python}
src=$("$py" -c "from mlx_h2o.models import resolve_model; print(resolve_model('$name'))")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m mlx_lm convert --hf-path "$src" -q --q-bits "$bits" --q-group-size 64 \
  --mlx-path "$tmp/model" >/dev/null
rm -rf .gpu/model && mkdir -p .gpu/model
tar -cf - -C "$tmp/model" . | split -b 46000000 -a 1 - "$tmp/part."
i=1
for part in "$tmp"/part.*; do
  mkdir -p ".gpu/model/m$i" && mv "$part" ".gpu/model/m$i/model.tar.$i"
  i=$((i + 1))
done
sha256sum "$tmp"/model/model.safetensors | cut -d' ' -f1 > .gpu/model/m$((i - 1))/weights.sha256
echo "$name, $bits-bit: $(ls .gpu/model | wc -l) parts in .gpu/model ($(du -sh .gpu/model | cut -f1))"
