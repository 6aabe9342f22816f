// H2O policy as MLX ops on (B, n_kv_heads, N) arrays: the device twin of
// H2OCore's H2OPolicy (mirrors mlx_h2o/policy.py op for op).

import H2OCore
import MLX

extension H2OPolicy {

    /// Folds one attention call into the running scores.
    ///
    /// Shapes: score, count, positions (B, n_kv_heads, N); logits (B, n_heads, L, N)
    /// with masked entries -inf; lse (B, n_heads, L). `count` gains the number of
    /// queries that could see each key (visibility from the group's first head).
    /// `window` > 0 folds only the last `window` queries; `pool` > 1 max-pools a
    /// chunk's (L > 1) contribution over keys within `pool / 2` positions.
    public static func foldScores(
        mode: ScoreMode, score: MLXArray, count: MLXArray, logits: MLXArray, lse: MLXArray,
        alpha: Double, window: Int = 0, positions: MLXArray? = nil, pool: Int = 0
    ) -> (MLXArray, MLXArray) {
        let L = logits.dim(2)
        var (logits, lse) = (logits, lse)
        if 0 < window && window < L {
            (logits, lse) = (logits[0..., 0..., (L - window)...], lse[0..., 0..., (L - window)...])
        }
        let (B, Hq, Lw, N) = (logits.dim(0), logits.dim(1), logits.dim(2), logits.dim(3))
        let Hk = score.dim(1)
        let lg = logits.reshaped(B, Hk, Hq / Hk, Lw, N)
        let visible = lg[0..., 0..., 0] .> -Float.infinity  // (B, Hk, Lw, N)
        let seen = visible.asType(.float32).sum(axis: 2)  // (B, Hk, N)
        let mag =
            mode == .ema
            ? which(expandedDimensions(visible, axis: 2), abs(lg), MLXArray(Float(0)))
            : exp(lg - lse.reshaped(B, Hk, Hq / Hk, Lw, 1))
        var step = mag.mean(axis: 2).sum(axis: 2)  // (B, Hk, N)
        if pool > 1 && L > 1, let positions {
            step = poolNeighbours(step, positions: positions, radius: pool / 2)
        }
        switch mode {
        case .ema, .attentionEma:
            step = step / maximum(seen, MLXArray(Float(1)))
            let ema = which(
                count .> Float(0), Float(alpha) * score + Float(1.0 - alpha) * step, step)
            return (which(seen .> Float(0), ema, score), count + seen)
        case .accumulated, .normalized:
            return (score + step, count + seen)
        case .tova:
            let last = step / maximum(seen, MLXArray(Float(1)))
            return (which(seen .> Float(0), last, score), count + seen)
        }
    }

    /// Max of `x` (>= 0) over slots whose positions lie within `radius`; see the
    /// CPU twin ``poolNeighbours(_:positions:radius:)``. Shapes: (B, n_kv_heads, N).
    public static func poolNeighbours(_ x: MLXArray, positions: MLXArray, radius: Int) -> MLXArray {
        let (B, Hk, N) = (x.dim(0), x.dim(1), x.dim(2))
        let pos = positions.asType(.int32)
        var out = x
        for d in 1 ..< max(1, min(radius + 1, N)) {
            let zeros = MLXArray.zeros([B, Hk, d], dtype: x.dtype)
            let far = MLXArray.zeros([B, Hk, d], dtype: .int32)
            // Padding positions can never be exactly d away.
            let big = far + Int32(1 << 30)
            let right = concatenated([x[.ellipsis, d...], zeros], axis: -1)
            let posRight = concatenated([pos[.ellipsis, d...], big], axis: -1)
            let left = concatenated([zeros, x[.ellipsis, ..<(N - d)]], axis: -1)
            let posLeft = concatenated([far - Int32(1 << 30), pos[.ellipsis, ..<(N - d)]], axis: -1)
            let zero = MLXArray(Float(0))
            out = maximum(out, which((posRight - pos) .== d, right, zero))
            out = maximum(out, which((pos - posLeft) .== d, left, zero))
        }
        return out
    }

    /// The number that ranks tokens: higher is kept.
    public static func evictionScore(mode: ScoreMode, score: MLXArray, count: MLXArray)
        -> MLXArray
    {
        mode == .normalized ? score / maximum(count, MLXArray(Float(1))) : score
    }

    /// Slots that are never evicted, given `offset` tokens seen (incl. new ones).
    public static func isProtected(positions: MLXArray, offset: Int, config: H2OConfig)
        -> MLXArray
    {
        var keep = (positions .< config.sinkSize) | (positions .>= offset - config.recentBudget)
        for range in config.pinned {
            keep = keep | ((positions .>= range.lowerBound) & (positions .< range.upperBound))
        }
        return keep
    }

    /// Eviction priority: +inf protected, -inf outside a sliding window.
    public static func priority(
        score: MLXArray, protected: MLXArray, positions: MLXArray, offset: Int, windowSize: Int?
    ) -> MLXArray {
        var pri = which(protected, MLXArray(Float.infinity), score)
        if let windowSize {
            // The newest query sits at offset - 1; older keys are invisible to it.
            pri = which(positions .<= offset - 1 - windowSize, MLXArray(-Float.infinity), pri)
        }
        return pri
    }

    /// Unique int64 keys ordering slots by (priority, position); see
    /// ``orderKey(priority:position:)`` for the CPU twin.
    public static func orderKeys(priorities: MLXArray, positions: MLXArray) -> MLXArray {
        let bits = view(priorities.asType(.float32) + Float(0), dtype: .int32)  // + 0 folds -0
        let b = bits.asType(.int64)
        // Int64 constants as arrays: an Int scalar would go through Int32.
        let (zero, flip, high) = (MLXArray(Int64(0)), MLXArray(Int64(2_147_483_649)), MLXArray(Int64(1) << 32))
        // For negative b, -b - 2^31 - 1 == b ^ 0x7FFFFFFF (sign kept, magnitude bits flipped).
        let ordered = which(b .>= zero, b, -b - flip)
        return ordered * high + positions.asType(.int64)
    }

    /// (B, n_kv_heads) slot of the lowest (priority, position).
    public static func selectVictim(priorities: MLXArray, positions: MLXArray) -> MLXArray {
        argMin(orderKeys(priorities: priorities, positions: positions), axis: -1)
    }

    /// (B, n_kv_heads, k) slots of the k highest keys, in position order;
    /// slots where `drop` is true rank below every other.
    public static func selectKeep(
        priorities: MLXArray, positions: MLXArray, k: Int, drop: MLXArray? = nil
    ) -> MLXArray {
        var keys = orderKeys(priorities: priorities, positions: positions)
        if let drop { keys = which(drop, MLXArray(Int64.min), keys) }
        let n = keys.dim(-1)
        let top = argSort(keys, axis: -1)[.ellipsis, (n - k)...]
        let order = argSort(takeAlong(positions, top, axis: -1), axis: -1)
        return takeAlong(top, order, axis: -1)
    }

    /// `priorities` with protected slots other than sinks just below the sinks
    /// (``sinksFirst(priority:position:sinkSize:)`` for each slot).
    public static func sinksFirst(priorities: MLXArray, positions: MLXArray, sinkSize: Int)
        -> MLXArray
    {
        let top = which(
            positions .< Int32(sinkSize), MLXArray(Float.infinity),
            MLXArray(Float.greatestFiniteMagnitude))
        return which(priorities .== Float.infinity, top, priorities)
    }
}
