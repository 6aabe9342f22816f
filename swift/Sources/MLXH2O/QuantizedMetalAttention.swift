// The fused Metal attention over quantized K/V (mirrors fused_quantized_attention
// in mlx_h2o/kernels/quantized_gpu.py; one precision segment, as QuantizedSlots).

import H2OKernels
import MLX

/// The quantized kernel's view of a mask: kind, head mode, array.
private func quantizedKernelMask(_ mask: ScoresMask, L: Int, Hq: Int)
    -> (kind: KernelMask, headMode: Int, array: MLXArray?)
{
    switch mask {
    case .none: return (.none, 0, nil)
    case .causal: return L == 1 ? (.none, 0, nil) : (.causal, 0, nil)
    case .array(let m):
        let heads = m.ndim >= 3 ? m.dim(-3) : 1  // shapes are right-aligned
        let mode = heads == 1 ? 0 : (heads == Hq ? 1 : 2)
        return (m.dtype == .bool ? .bool : .add, mode, m)
    }
}

/// (out, logits, lse) from the fused quantized kernel, or nil where it does not
/// apply (no Metal device, L > 8, head dim not in the kernel's list). Rows of
/// more than `quantizedSinglePassN` keys split them and merge in a second launch.
func metalQuantizedAttention(
    queries q: MLXArray, keys: QuantizedTriple, values: QuantizedTriple, scale: Float,
    bits: Int, groupSize: Int, mask: ScoresMask, sinks: MLXArray?
) -> (output: MLXArray, logits: MLXArray, lse: MLXArray)? {
    let (B, Hq, L, D) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3))
    let Hk = keys.weights.dim(1)
    let valueDim = values.scales.dim(-1) * groupSize
    guard metalAvailable, L <= KernelConstants.quantizedMaxL,
        KernelConstants.quantizedHeadDims.contains(D), valueDim == D, Hq % Hk == 0
    else { return nil }
    let (kind, headMode, maskArray) = quantizedKernelMask(mask, L: L, Hq: Hq)
    let N = keys.weights.dim(2)
    let rows = B * Hq * L
    let S = chooseQuantizedSplits(keys: N, rows: rows)
    let kernel = MetalKernelCache.shared(
        MetalKernels.quantized(mask: kind, sinks: sinks != nil, two: false, split: S > 1))
    var inputs: [MLXArray] = [q, keys.weights, keys.scales, keys.biases]
    inputs += [values.weights, values.scales, values.biases]
    if let maskArray { inputs.append(maskArray) }
    if let sinks, S == 1 { inputs.append(sinks) }  // with splits, the merge takes them
    // The scale goes in as its float bits (a template constant), as in Python.
    let template: [(String, KernelTemplateArg)] = [
        ("T", q.dtype), ("D", D), ("GS", groupSize), ("G", Hq / Hk), ("B0", bits), ("B1", bits),
        ("MH", headMode), ("SCALE_BITS", Int(Int32(bitPattern: scale.bitPattern))),
    ]
    let NT = KernelConstants.quantizedThreadsPerBlock
    if S == 1 {
        let r = kernel(
            inputs, template: template, grid: (rows * NT, 1, 1), threadGroup: (NT, 1, 1),
            outputShapes: [[B, Hq, L, D], [B, Hq, L, N], [B, Hq, L]],
            outputDTypes: [q.dtype, .float32, .float32])
        return (r[0], r[1], r[2])
    }
    let parts = kernel(
        inputs, template: template, grid: (rows * NT, S, 1), threadGroup: (NT, 1, 1),
        outputShapes: [[B, Hq, L, N], [rows, S, D], [rows, S]],
        outputDTypes: [.float32, .float32, .float32])
    let merge = MetalKernelCache.shared(MetalKernels.quantizedMerge(sinks: sinks != nil))
    let r = merge(
        [q, parts[1], parts[2]] + (sinks.map { [$0] } ?? []), template: [("T", q.dtype), ("D", D)],
        grid: (rows * NT, 1, 1), threadGroup: (NT, 1, 1), outputShapes: [[B, Hq, L, D], [B, Hq, L]],
        outputDTypes: [q.dtype, .float32])
    return (r[0], parts[0], r[1])
}
