// The fused H2O decode step on Metal: attention + score fold + next victim in
// one or two launches (mirrors mlx_h2o/kernels/h2o_step.py).

import H2OCore
import H2OKernels
import MLX

/// Results of one fused decode step (new arrays; inputs are not modified).
public struct H2OStep {
    /// (B, n_heads, 1, D) in the queries' dtype.
    public let output: MLXArray
    /// (B, n_kv_heads, cap) int32; the new token's slot holds `offset - 1`.
    public let positions: MLXArray
    /// (B, n_kv_heads, cap) float32, this step folded in.
    public let score: MLXArray
    public let count: MLXArray
    /// (B, n_kv_heads, 1, D) int32: the slot to overwrite next step (priorities at
    /// offset + 1), repeated along D so it indexes the K/V writes as is.
    public let victim: MLXArray
    public let logits: MLXArray
    public let lse: MLXArray
}

/// Whether ``metalH2ODecodeStep`` runs for these inputs.
public func metalH2OStepSupported(
    queries q: MLXArray, keys k: MLXArray, values v: MLXArray, positions: MLXArray,
    mask: ScoresMask = .none, sinks: MLXArray? = nil
) -> Bool {
    guard metalDecodeSupported(queries: q, keys: k, values: v, mask: mask, sinks: sinks),
        q.dim(2) == 1, positions.ndim == 3
    else { return false }
    return positions.dim(0) == k.dim(0) && positions.dim(1) == k.dim(1)
        && positions.dim(2) >= k.dim(2)
}

/// One H2O decode step on the GPU (L == 1).
///
/// Shapes: queries (B, n_heads, 1, D); keys, values (B, n_kv_heads, N, D), the
/// first N slots of the cache buffers with the new token already written;
/// positions (int32), score, count (float32) (B, n_kv_heads, cap) whole buffers
/// as they were before this token. `slot` (B, n_kv_heads[, 1, D]) int32 is where the new
/// token went (the previous step's victim), or nil with `appendSlot` (the same
/// slot for every row while the cache fills). `offset` counts the new token.
public func metalH2ODecodeStep(
    queries q: MLXArray, keys k: MLXArray, values v: MLXArray, positions: MLXArray,
    score: MLXArray, count: MLXArray, slot: MLXArray?, appendSlot: Int? = nil, offset: Int,
    scale: Float, config: H2OConfig, windowSize: Int? = nil, mask: ScoresMask = .none,
    sinks: MLXArray? = nil, numSplits: Int? = nil
) -> H2OStep {
    precondition((slot == nil) != (appendSlot == nil), "pass exactly one of slot and appendSlot")
    precondition(
        metalH2OStepSupported(queries: q, keys: k, values: v, positions: positions, mask: mask, sinks: sinks),
        "metalH2ODecodeStep: inputs not supported on this device")
    let (B, Hq, D) = (q.dim(0), q.dim(1), q.dim(3))
    let (Hk, N, cap) = (k.dim(1), k.dim(2), positions.dim(2))
    let G = Hq / Hk
    let lay = LaunchLayout(D: D, itemSize: q.dtype.size, G: G, L: 1)
    let (kind, headMode, maskArray) = kernelMask(mask, B: B, Hq: Hq, Hk: Hk, L: 1, N: N)!
    let units = B * Hk * lay.rowTiles
    var S = numSplits ?? chooseSplits(keys: N, units: units, tile: lay.tile, D: D)
    if G > KernelConstants.fusedMaxGroup { S = max(S, 2) }  // the fold then runs in pass 2
    // The one-pass kernel with an array mask binds 32-33 buffers, past the 31
    // of a Metal kernel's argument table; the two passes fit.
    S = max(kind == .bool || kind == .add ? 2 : 1, min(S, KernelConstants.maxSplits))
    let prmI = MLXArray(
        [offset, appendSlot ?? -1, windowSize ?? 0, config.sinkSize, config.recentBudget, N]
            .map(Int32.init))  // N: keys attended (the kernels' valid count)
    let slotArray = slot ?? MLXArray.zeros([1, 1], dtype: .int32)
    let prm = MLXArray([scale, Float(config.emaAlpha), Float(1.0 - config.emaAlpha)])
    // An empty range stands in for "no pins": the kernel reads at least one row.
    let pairs = config.pinned.isEmpty ? [0 ..< 0] : config.pinned
    let pins = MLXArray(pairs.flatMap { [Int32($0.lowerBound), Int32($0.upperBound)] }).reshaped(pairs.count, 2)
    var head: [MLXArray] = [q, k, v, prm]
    if let maskArray { head.append(maskArray) }
    if let sinks, S == 1 { head.append(sinks) }
    let mode = KernelConstants.scoreModes.firstIndex(of: config.score.rawValue)!
    var template: [(String, KernelTemplateArg)] = [("T", q.dtype)]
    template += lay.template(D: D, L: 1, G: G, kvHeads: Hk).map { ($0.0, $0.1 as KernelTemplateArg) }
    let NT = KernelConstants.threadsPerBlock
    let stateShapes = [[B, Hk, cap], [B, Hk, cap], [B, Hk, cap], [B, Hk, 1, D]]  // victim repeated along D
    let stateDTypes: [DType] = [.int32, .float32, .float32, .int32]
    if S == 1 {
        let pass1 = MetalKernelCache.shared(
            MetalKernels.pass1(mask: kind, sinks: sinks != nil, split: false, fused: true))
        let r = pass1(
            head + [positions, slotArray, prmI, score, count, pins],
            template: template + [("MH", headMode), ("MODE", mode)], grid: (units * NT, 1, 1),
            threadGroup: (NT, 1, 1), outputShapes: [[B, Hq, 1, D], [B, Hq, 1, N], [B, Hq, 1]] + stateShapes,
            outputDTypes: [q.dtype, .float32, .float32] + stateDTypes)
        return H2OStep(
            output: r[0], positions: r[3], score: r[4], count: r[5], victim: r[6], logits: r[1],
            lse: r[2])
    }
    let pass1 = MetalKernelCache.shared(
        MetalKernels.pass1(mask: kind, sinks: sinks != nil, split: true, fused: true))
    let parts = pass1(
        head + [positions, slotArray, prmI], template: template + [("MH", headMode), ("MODE", mode)],
        grid: (units * NT, S, 1), threadGroup: (NT, 1, 1),
        outputShapes: [[B, Hq, 1, N], [units, S, lay.rows, D], [units, S, lay.rows, 2]],
        outputDTypes: [.float32, .float32, .float32])
    let pass2 = MetalKernelCache.shared(MetalKernels.pass2(sinks: sinks != nil, fused: true))
    let r = pass2(
        [parts[1], parts[2]] + (sinks.map { [$0] } ?? [])
            + [parts[0], positions, score, count, slotArray, prmI, prm, pins],
        template: template + [("MODE", mode)], grid: (B * Hk * NT, 1, 1), threadGroup: (NT, 1, 1),
        outputShapes: [[B, Hq, 1, D], [B, Hq, 1]] + stateShapes,
        outputDTypes: [q.dtype, .float32] + stateDTypes)
    return H2OStep(
        output: r[0], positions: r[2], score: r[3], count: r[4], victim: r[5], logits: parts[0],
        lse: r[1])
}
