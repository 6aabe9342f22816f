#!/bin/sh
# Apply swift/patches/*.patch (the H2O routing hook) to an mlx-swift-lm checkout.
# Usage: swift/scripts/apply-patches.sh /path/to/mlx-swift-lm
# Idempotent: a checkout that already has the hook is left as it is.
set -eu
checkout=${1:?usage: $0 /path/to/mlx-swift-lm}
patches=$(cd "$(dirname "$0")/../patches" && pwd)
target="$checkout/Libraries/MLXLMCommon/AttentionUtils.swift"
[ -f "$target" ] || { echo "error: $target not found: not an mlx-swift-lm checkout" >&2; exit 1; }
if grep -q "KVCacheAttentionProtocol" "$target"; then
    echo "mlx-swift-lm at $checkout already routes KVCacheAttentionProtocol caches"
    exit 0
fi
# Check every patch first, so a checkout is never left half patched.
for p in "$patches"/*.patch; do
    if ! git -C "$checkout" apply --check "$p" 2>/dev/null; then
        echo "error: $(basename "$p") does not apply to $checkout." >&2
        echo "It applies to mlx-swift-lm 3.31.3, 3.31.4 and main at 14414441 (see docs/SWIFT.md);" >&2
        echo "the hook is 4 lines at the top of attentionWithCacheUpdate: add them by hand." >&2
        exit 1
    fi
done
for p in "$patches"/*.patch; do
    git -C "$checkout" apply "$p"
    echo "applied $(basename "$p")"
done
