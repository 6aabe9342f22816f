// swift-tools-version: 5.9
// Type-checks MLXH2O on any OS against stubs of the mlx-swift / mlx-swift-lm
// signatures it uses (Sources/MLX, Sources/MLXLMCommon: signatures as read
// from those packages, bodies empty). It proves our own code is consistent;
// it does not prove the stubs match the real packages. `make -C swift typecheck`.

import PackageDescription

let package = Package(
    name: "mlxh2o-typecheck",
    targets: [
        .target(name: "MLX"),
        .target(name: "MLXLMCommon", dependencies: ["MLX"]),
        .target(name: "H2OCore"),
        .target(name: "H2OKernels"),
        .target(
            name: "MLXH2O", dependencies: ["H2OCore", "H2OKernels", "MLX", "MLXLMCommon"],
            swiftSettings: [.define("MLXH2O_ROUTED")]),
    ]
)
