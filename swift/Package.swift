// swift-tools-version: 5.9
// mlx-h2o for Swift: H2OCore and H2OKernels (pure Swift; build and test anywhere)
// and MLXH2O (mlx-swift + mlx-swift-lm: Apple platforms, or Linux on mlx-swift's CPU
// backend). MLXH2O and its tests join the package only when asked for, so plain
// `swift build` / `swift test` build H2OCore alone:
//   MLXH2O_MLX_SWIFT_LM=/path/to/mlx-swift-lm  a local checkout (patched with
//                                              scripts/apply-patches.sh for routing)
//   MLXH2O_MLX_SWIFT=/path/to/mlx-swift        a local mlx-swift too (offline builds;
//                                              `make mlx-linux` assembles both)
//   MLXH2O_WITH_MLX=1                          the pinned remote release (no routing)
// See docs/SWIFT.md.

import Foundation
import PackageDescription

let environment = Context.environment
let localLM = environment["MLXH2O_MLX_SWIFT_LM"].flatMap { $0.isEmpty ? nil : $0 }
// A local mlx-swift (swift/scripts/assemble-checkout.sh builds one for Linux).
let localMLX = environment["MLXH2O_MLX_SWIFT"].flatMap { $0.isEmpty ? nil : $0 }
let withMLX = localLM != nil || environment["MLXH2O_WITH_MLX"] == "1"
// patches/0001 adds this file; with it, H2OKVCache conforms to KVCacheAttentionProtocol.
let routed = localLM.map {
    FileManager.default.fileExists(atPath: "\($0)/Libraries/MLXLMCommon/KVCacheAttention.swift")
} ?? false
// SwiftPM names a local package after its folder.
let lmPackage = localLM.map { URL(fileURLWithPath: $0).lastPathComponent } ?? "mlx-swift-lm"

let package = Package(
    name: "mlx-h2o",
    platforms: [.macOS(.v14), .iOS(.v17)],
    products: [
        .library(name: "H2OCore", targets: ["H2OCore"])
    ],
    targets: [
        .target(name: "H2OCore"),
        // The Metal kernel source (generated from the Python package) and its
        // assembly and launch plans: plain strings and integers, checked on any OS.
        .target(name: "H2OKernels"),
        // Reads the shared JSON vectors from Tests/Vectors by #filePath.
        .target(name: "H2OVectors", dependencies: ["H2OCore"], path: "Tests/H2OVectors"),
        .testTarget(name: "H2OCoreTests", dependencies: ["H2OCore", "H2OKernels", "H2OVectors"]),
    ]
)

if withMLX {
    package.dependencies += [
        localLM.map { .package(path: $0) }
            ?? .package(url: "https://github.com/ml-explore/mlx-swift-lm", exact: "3.31.3"),
        localMLX.map { .package(path: $0) }
            ?? .package(url: "https://github.com/ml-explore/mlx-swift", .upToNextMinor(from: "0.31.3")),
    ]
    package.products.append(.library(name: "MLXH2O", targets: ["MLXH2O"]))
    package.targets.append(
        .target(
            name: "MLXH2O",
            dependencies: [
                "H2OCore", "H2OKernels",
                .product(name: "MLX", package: "mlx-swift"),
                .product(name: "MLXLMCommon", package: lmPackage),
            ],
            swiftSettings: routed ? [.define("MLXH2O_ROUTED")] : []))
    // The caches on real MLX arrays (CPU), against float64 and the Python vectors;
    // a tiny Llama through attentionWithCacheUpdate where routed. `make mlx-linux`.
    package.targets.append(
        .testTarget(
            name: "MLXH2OTests",
            dependencies: [
                "MLXH2O", "H2OCore", "H2OVectors",
                .product(name: "MLX", package: "mlx-swift"),
                .product(name: "MLXLMCommon", package: lmPackage),
                .product(name: "MLXLLM", package: lmPackage),
            ],
            swiftSettings: routed ? [.define("MLXH2O_ROUTED")] : []))
}
