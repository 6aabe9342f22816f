#!/bin/sh
# Assemble local source trees of mlx-swift (+ its mlx / mlx-c submodules and
# package dependencies) and mlx-swift-lm into one folder that SwiftPM builds
# without the network: every package dependency becomes a local path.
#
# Usage: swift/scripts/assemble-checkout.sh DEST
#   MLX_SWIFT=path        mlx-swift source tree (required)
#   MLX=path MLX_C=path   its submodules, where MLX_SWIFT/Source/Cmlx/mlx{,-c} are empty
#   SWIFT_NUMERICS=path SWIFT_ARGUMENT_PARSER=path   mlx-swift's package dependencies (required)
#   MLX_SWIFT_LM=path     mlx-swift-lm source tree (optional; gets the routing patches)
#
# DEST gets mlx-swift/, swift-numerics/, swift-argument-parser/ and mlx-swift-lm/.
# Each tree is copied once (file times kept, so a rebuild reuses SwiftPM's objects);
# a changed source path copies it again. Manifest edits, all in DEST only:
#   - mlx-swift: dependencies by local path. On Linux without CUDA its manifest leaves
#     out MLX's MLXFast.swift / MLXFastKernel.swift and mlx-c's fast.cpp, so MLXNN (and
#     with it MLXLMCommon) cannot compile; they are put back, as mlx-swift's CMake build
#     on Linux has them (MLX's no-Metal stubs define metal_kernel, which then throws).
#     GPU+CUDA.swift (plain Swift: `enum GPU` without a working-set size) is put back
#     too: MLXLMCommon calls GPU.maxRecommendedWorkingSetBytes().
#   - mlx-swift-lm: a manifest of MLXLMCommon and MLXLLM alone (the other libraries
#     need swift-syntax macros, tokenizers or Apple frameworks), with local mlx-swift.
set -eu
dest=${1:?usage: $0 DEST (see the header for the environment)}
: "${MLX_SWIFT:?set MLX_SWIFT to an mlx-swift source tree}"
: "${SWIFT_NUMERICS:?set SWIFT_NUMERICS to a swift-numerics source tree}"
: "${SWIFT_ARGUMENT_PARSER:?set SWIFT_ARGUMENT_PARSER to a swift-argument-parser source tree}"
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)

# copy SRC DST: copy a tree once per source path (DEST/.assembled/ records it).
copy() {
    src=$(cd "$1" && pwd)
    stamp="$dest/.assembled/$(echo "${2#$dest/}" | tr / _)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$src" ]; then
        return
    fi
    rm -rf "$2" "$stamp"_*  # and the trees copied into it
    mkdir -p "$2"
    (cd "$src" && tar --exclude=.git --exclude=.build -cf - .) | (cd "$2" && tar -xpf -)
    mkdir -p "$dest/.assembled" && echo "$src" >"$stamp"
    echo "copied $src -> $2"
}

# write FILE: stdin replaces FILE only where it differs (keeps SwiftPM's manifest cache).
write() {
    tmp="$1.tmp.$$"
    cat >"$tmp"
    if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv "$tmp" "$1"; fi
}

copy "$MLX_SWIFT" "$dest/mlx-swift"
copy "$SWIFT_NUMERICS" "$dest/swift-numerics"
copy "$SWIFT_ARGUMENT_PARSER" "$dest/swift-argument-parser"
for sub in mlx mlx-c; do
    dir="$dest/mlx-swift/Source/Cmlx/$sub"
    var=$(echo "$sub" | tr 'a-z-' 'A-Z_')
    eval "path=\${$var:-}"
    if [ -n "$path" ]; then
        copy "$path" "$dir"
    elif [ -z "$(ls -A "$dir" 2>/dev/null)" ]; then
        echo "error: $dir is empty: set $var to its source tree" >&2
        exit 1
    fi
done

manifest="$dest/mlx-swift/Package.swift"
[ -f "$manifest.upstream" ] || cp -p "$manifest" "$manifest.upstream"
sed -e 's|\.package(url: "https://github.com/apple/swift-numerics"[^)]*)|.package(path: "../swift-numerics")|' \
    -e 's|\.package(url: "https://github.com/apple/swift-argument-parser"[^)]*)|.package(path: "../swift-argument-parser")|' \
    -e '/"mlx-c\/mlx\/c\/fast.cpp",  \/\/ Exclude on Linux/d' \
    "$manifest.upstream" |
    awk '/^        mlxSwiftExcludes = \[/ { n++ }
         n == 2 && /"MLXFast.swift",|"MLXFastKernel.swift",|"GPU\+CUDA.swift",/ { next }
         { print }' | write "$manifest"
grep -q 'package(path: "../swift-numerics")' "$manifest" || {
    echo "error: $manifest: the swift-numerics dependency was not found to rewrite" >&2; exit 1; }

if [ -n "${MLX_SWIFT_LM:-}" ]; then
    copy "$MLX_SWIFT_LM" "$dest/mlx-swift-lm"
    lm="$dest/mlx-swift-lm"
    [ -f "$lm/Package.swift.upstream" ] || cp -p "$lm/Package.swift" "$lm/Package.swift.upstream"
    write "$lm/Package.swift" <<'MANIFEST'
// swift-tools-version: 6.2
// MLXLMCommon and MLXLLM of mlx-swift-lm over a local mlx-swift (written by mlx-h2o's
// swift/scripts/assemble-checkout.sh; the upstream manifest is Package.swift.upstream).
import PackageDescription

let mlx: [Target.Dependency] = [
    .product(name: "MLX", package: "mlx-swift"),
    .product(name: "MLXNN", package: "mlx-swift"),
    .product(name: "MLXOptimizers", package: "mlx-swift"),
]
let package = Package(
    name: "mlx-swift-lm",
    platforms: [.macOS(.v14), .iOS(.v17)],
    products: [
        .library(name: "MLXLMCommon", targets: ["MLXLMCommon"]),
        .library(name: "MLXLLM", targets: ["MLXLLM"]),
    ],
    dependencies: [.package(path: "../mlx-swift")],
    targets: [
        .target(
            name: "MLXLMCommon", dependencies: mlx, path: "Libraries/MLXLMCommon",
            exclude: ["README.md"]),
        .target(
            name: "MLXLLM", dependencies: ["MLXLMCommon"] + mlx, path: "Libraries/MLXLLM",
            exclude: ["README.md"]),
    ]
)
MANIFEST
    "$here/apply-patches.sh" "$lm"
fi
echo "assembled $dest"
