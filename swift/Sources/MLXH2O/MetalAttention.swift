// The Metal decode kernels (the Python package's kernel text, see H2OKernels)
// through MLXFast.metalKernel, and the dispatch between them and the reference
// (mirrors mlx_h2o/kernels/__init__.py, decode.py and quantized_gpu.py).

import Foundation
import H2OKernels
import MLX

/// Kernel objects, built once per variant; MLX compiles each on first use.
final class MetalKernelCache: @unchecked Sendable {
    static let shared = MetalKernelCache()
    private let lock = NSLock()
    private var kernels: [String: MLXFast.MLXFastKernel] = [:]

    func callAsFunction(_ v: KernelVariant) -> MLXFast.MLXFastKernel {
        lock.lock()
        defer { lock.unlock() }
        if let kernel = kernels[v.name] { return kernel }
        // ensureRowContiguous false: cache slices are read in place through their strides.
        let kernel = MLXFast.metalKernel(
            name: v.name, inputNames: v.inputNames, outputNames: v.outputNames, source: v.body,
            header: v.header, ensureRowContiguous: false)
        kernels[v.name] = kernel
        return kernel
    }
}

private let kernelDTypes: [DType] = [.float16, .bfloat16, .float32]

/// Whether the default device runs Metal kernels.
var metalAvailable: Bool {
    #if os(macOS) || os(iOS) || os(visionOS) || os(tvOS)
        return Device.defaultDevice() == .gpu
    #else
        return false
    #endif
}

/// The decode kernels' view of a mask, or nil where they do not take it.
func kernelMask(_ mask: ScoresMask, B: Int, Hq: Int, Hk: Int, L: Int, N: Int)
    -> (kind: KernelMask, headMode: Int, array: MLXArray?)?
{
    switch mask {
    case .none: return (.none, 0, nil)
    case .causal: return (.causal, 0, nil)
    case .array(let m):
        guard
            let (kind, mode) = kernelMask(
                shape: m.shape, isBool: m.dtype == .bool, isFloat: kernelDTypes.contains(m.dtype),
                B: B, heads: Hq, kvHeads: Hk, L: L, N: N)
        else { return nil }
        return (kind, mode, m)
    }
}

/// Whether the Metal decode kernels take these inputs (else use the reference).
public func metalDecodeSupported(
    queries q: MLXArray, keys k: MLXArray, values v: MLXArray, mask: ScoresMask = .none,
    sinks: MLXArray? = nil
) -> Bool {
    guard metalAvailable, q.ndim == 4, k.ndim == 4, v.ndim == 4 else { return false }
    let (B, Hq, L, D) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3))
    let (Hk, N) = (k.dim(1), k.dim(2))
    guard q.dtype == k.dtype, k.dtype == v.dtype, kernelDTypes.contains(q.dtype) else { return false }
    guard (1 ... 8).contains(L), N >= 1, Hk >= 1, Hq % Hk == 0 else { return false }
    guard k.dim(0) == B, v.shape == [B, Hk, N, D], k.dim(3) == D, D % 8 == 0, D <= 256 else {
        return false
    }
    if let sinks, sinks.ndim != 1 || sinks.dim(0) != Hq { return false }
    return kernelMask(mask, B: B, Hq: Hq, Hk: Hk, L: L, N: N) != nil
}

/// GPU twin of the reference (decode, L <= 8): (out, logits float32, lse float32).
/// `numSplits` overrides the key split count (1: a single pass).
public func metalDecodeAttention(
    queries q: MLXArray, keys k: MLXArray, values v: MLXArray, scale: Float,
    mask: ScoresMask = .none, sinks: MLXArray? = nil, numSplits: Int? = nil
) -> (output: MLXArray, logits: MLXArray, lse: MLXArray) {
    let (B, Hq, L, D) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3))
    let (Hk, N) = (k.dim(1), k.dim(2))
    let G = Hq / Hk
    let lay = LaunchLayout(D: D, itemSize: q.dtype.size, G: G, L: L)
    let (kind, headMode, maskArray) = kernelMask(mask, B: B, Hq: Hq, Hk: Hk, L: L, N: N)!
    let units = B * Hk * lay.rowTiles
    let NT = KernelConstants.threadsPerBlock
    let S = max(1, min(numSplits ?? chooseSplits(keys: N, units: units, tile: lay.tile, D: D), KernelConstants.maxSplits))
    // (1 - alpha) rounded once from double, as the policy's ops do; alpha unused here.
    let prm = MLXArray([scale, Float(0.95), Float(1.0 - 0.95)])
    var inputs: [MLXArray] = [q, k, v, prm]
    if let maskArray { inputs.append(maskArray) }
    if let sinks, S == 1 { inputs.append(sinks) }  // with splits, pass 2 takes them
    var template: [(String, KernelTemplateArg)] = [("T", q.dtype)]
    template += lay.template(D: D, L: L, G: G, kvHeads: Hk).map { ($0.0, $0.1 as KernelTemplateArg) }
    let pass1 = MetalKernelCache.shared(
        MetalKernels.pass1(mask: kind, sinks: sinks != nil, split: S > 1, fused: false))
    if S == 1 {
        let r = pass1(
            inputs, template: template + [("MH", headMode)], grid: (units * NT, 1, 1),
            threadGroup: (NT, 1, 1), outputShapes: [[B, Hq, L, D], [B, Hq, L, N], [B, Hq, L]],
            outputDTypes: [q.dtype, .float32, .float32])
        return (r[0], r[1], r[2])
    }
    let parts = pass1(
        inputs, template: template + [("MH", headMode)], grid: (units * NT, S, 1),
        threadGroup: (NT, 1, 1),
        outputShapes: [[B, Hq, L, N], [units, S, lay.rows, D], [units, S, lay.rows, 2]],
        outputDTypes: [.float32, .float32, .float32])
    let pass2 = MetalKernelCache.shared(MetalKernels.pass2(sinks: sinks != nil, fused: false))
    let r = pass2(
        [parts[1], parts[2]] + (sinks.map { [$0] } ?? []), template: template,
        grid: (units * lay.rows * NT, 1, 1), threadGroup: (NT, 1, 1),  // a block per query row
        outputShapes: [[B, Hq, L, D], [B, Hq, L]], outputDTypes: [q.dtype, .float32])
    return (r[0], parts[0], r[1])
}

/// Attention with scores: the Metal decode kernels where they apply, else the
/// reference (same numbers up to float rounding; the reference is the spec).
public func attentionWithScores(
    queries: MLXArray, keys: MLXArray, values: MLXArray, scale: Float, mask: ScoresMask = .none,
    sinks: MLXArray? = nil, useKernel: Bool? = nil
) -> (output: MLXArray, logits: MLXArray, lse: MLXArray) {
    let ok = metalDecodeSupported(queries: queries, keys: keys, values: values, mask: mask, sinks: sinks)
    precondition(useKernel != true || ok, "no Metal kernel for these inputs")
    if useKernel ?? ok {
        return metalDecodeAttention(
            queries: queries, keys: keys, values: values, scale: scale, mask: mask, sinks: sinks)
    }
    return scaledDotProductAttentionWithScores(
        queries: queries, keys: keys, values: values, scale: scale, mask: mask, sinks: sinks)
}
