#!/usr/bin/env bash
# Builds the sglang bundle (lab/device/sglang.txt) in 2 parts instead of 5: the workplace's bundle.sh run
# from a temporary copy that also drops the sgl_kernel libraries an H200 never loads with
# attention_backend=triton (FlashAttention-3's flash_ops, sm100, flashmla, infllm;
# lab/results/sglang-feasibility.md says why each is unused). From the project root:
#
#   bash lab/device/bundle_sglang.sh     # -> .devbundle/sglang.tar.xz.00, .01 (+ meta), 4-9 minutes
#
# Stage it on a machine (or a /tmp/site) without the vllm bundle: the two pin different openai and xgrammar.
set -euo pipefail
[ -d .git ] || { echo "run from the project root" >&2; exit 2; }
shared=$(cd ../shared/device 2>/dev/null && pwd) || { echo "no ../shared/device/bundle.sh beside the project" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$shared"/* "$tmp/"
strip='if [ -d "$s/sgl_kernel" ]; then rm -f "$s/sgl_kernel/flash_ops.abi3.so" "$s/sgl_kernel/sm100/common_ops.abi3.so" "$s/sgl_kernel/flashmla_ops.abi3.so" "$s"/sgl_kernel/infllm_ops.*.so; fi'
line=$(grep -n '^tar -C "\$s"' "$tmp/bundle.sh" | cut -d: -f1)
[ -n "$line" ] || { echo "bundle.sh changed: its archive line was not found; strip by hand" >&2; exit 1; }
sed -i "$((line - 1))r /dev/stdin" "$tmp/bundle.sh" <<< "$strip"
bash "$tmp/bundle.sh" "$PWD/lab/device/sglang.txt"
