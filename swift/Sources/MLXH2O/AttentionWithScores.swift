// Reference attention that also returns its logits and lse, in plain MLX ops
// (mirrors mlx_h2o/kernels/reference.py; the Metal kernel is tested against it).

import MLX

/// A mask as the attention with scores takes it: nothing, bottom-right causal,
/// or an array (bool = attend, else additive) broadcastable to (B, n_heads, L, N)
/// or with a head axis of n_kv_heads (one mask per KV head, shared by its group).
public enum ScoresMask {
    case none
    case causal
    case array(MLXArray)

    init(_ mode: MLXFast.ScaledDotProductAttentionMaskMode) {
        switch mode {
        case .causal: self = .causal
        case .none: self = .none
        default: self = mode.mask.map { .array($0) } ?? .none
        }
    }
}

/// Bottom-right aligned causal mask (mlx-lm's "causal"): query i sits at key N - L + i.
public func causalMask(queries L: Int, keys N: Int) -> MLXArray {
    let q = MLXArray(Int32(N - L) ..< Int32(N)).reshaped(L, 1)
    return q .>= MLXArray(Int32(0) ..< Int32(N)).reshaped(1, N)  // (L, N)
}

/// The mask in the grouped layout (B|1, Hk|1, G|1, L, N), or nil.
func groupedMask(_ mask: ScoresMask, heads Hq: Int, kvHeads Hk: Int, queries L: Int, keys N: Int)
    -> MLXArray?
{
    switch mask {
    case .none:
        return nil
    case .causal:
        return causalMask(queries: L, keys: N).reshaped(1, 1, 1, L, N)
    case .array(var m):
        precondition(m.ndim <= 4, "mask must have at most 4 dims, got \(m.shape)")
        while m.ndim < 4 { m = expandedDimensions(m, axis: 0) }
        let heads = m.dim(1)
        if heads == Hq && Hq != Hk {  // (B, Hq, L, N) -> (B, Hk, G, L, N)
            return m.reshaped(m.dim(0), Hk, Hq / Hk, m.dim(2), m.dim(3))
        }
        precondition(
            heads == 1 || heads == Hk,
            "mask head axis \(heads) matches neither n_heads=\(Hq) nor n_kv_heads=\(Hk)")
        return expandedDimensions(m, axis: 2)
    }
}

/// Attention that also returns the logits it used and their log-sum-exp.
///
/// Shapes: queries (B, n_heads, L, D); keys (B, n_kv_heads, N, D); values
/// (B, n_kv_heads, N, Dv); sinks (n_heads) logits of an attention sink (an
/// extra softmax column with no value). Returns out (B, n_heads, L, Dv) in the
/// queries' dtype; logits float32 (B, n_heads, L, N) = scale * q.k (+ mask;
/// masked -> -inf); lse float32 (B, n_heads, L).
public func scaledDotProductAttentionWithScores(
    queries: MLXArray, keys: MLXArray, values: MLXArray, scale: Float, mask: ScoresMask = .none,
    sinks: MLXArray? = nil
) -> (output: MLXArray, logits: MLXArray, lse: MLXArray) {
    let (B, Hq, L, D) = (queries.dim(0), queries.dim(1), queries.dim(2), queries.dim(3))
    let (Hk, N) = (keys.dim(1), keys.dim(2))
    precondition(Hq % Hk == 0, "n_heads=\(Hq) is not a multiple of n_kv_heads=\(Hk)")
    let G = Hq / Hk
    let q = queries.asType(.float32).reshaped(B, Hk, G, L, D)
    let k = expandedDimensions(keys.asType(.float32), axis: 2)  // (B, Hk, 1, N, D)
    let v = expandedDimensions(values.asType(.float32), axis: 2)
    var logits = matmul(q, k.swappedAxes(-1, -2)) * scale  // (B, Hk, G, L, N)
    if let m = groupedMask(mask, heads: Hq, kvHeads: Hk, queries: L, keys: N) {
        logits =
            m.dtype == .bool
            ? which(m, logits, MLXArray(-Float.infinity)) : logits + m.asType(.float32)
    }
    var rowMax = logits.max(axis: -1, keepDims: true)
    var sink: MLXArray? = nil
    if let sinks {
        sink = sinks.asType(.float32).reshaped(1, Hk, G, 1, 1)
        rowMax = maximum(rowMax, sink!)
    }
    // Fully masked rows: keep the shift finite so they give out 0, lse -inf.
    let shift = which(abs(rowMax) .== Float.infinity, MLXArray(Float(0)), rowMax)
    let e = exp(logits - shift)
    var denom = e.sum(axis: -1, keepDims: true)
    if let sink { denom = denom + exp(sink - shift) }
    let lse = log(denom) + shift
    let probs = e / which(denom .> Float(0), denom, MLXArray(Float(1)))
    let out = matmul(probs, v).asType(queries.dtype)
    return (
        out.reshaped(B, Hq, L, -1), logits.reshaped(B, Hq, L, N), lse.reshaped(B, Hq, L)
    )
}
