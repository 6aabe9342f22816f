// H2O policy as MLX ops on (B, n_kv_heads, N) arrays: the device twin of
// H2OCore's H2OPolicy (mirrors mlx_h2o/policy.py op for op).

import H2OCore
import MLX

extension H2OPolicy {

    /// Folds one attention call into the running scores.
    ///
    /// Shapes: score, count (B, n_kv_heads, N) float32; logits (B, n_heads, L, N)
    /// with masked entries -inf; lse (B, n_heads, L). `count` gains the number of
    /// queries that could see each key (visibility from the group's first head).
    /// `window` > 0 folds only the last `window` queries.
    public static func foldScores(
        mode: ScoreMode, score: MLXArray, count: MLXArray, logits: MLXArray, lse: MLXArray,
        alpha: Double, window: Int = 0
    ) -> (MLXArray, MLXArray) {
        var (logits, lse) = (logits, lse)
        if 0 < window && window < logits.dim(2) {
            let start = logits.dim(2) - window
            (logits, lse) = (logits[0..., 0..., start...], lse[0..., 0..., start...])
        }
        let (B, Hq, L, N) = (logits.dim(0), logits.dim(1), logits.dim(2), logits.dim(3))
        let Hk = score.dim(1)
        let lg = logits.reshaped(B, Hk, Hq / Hk, L, N)
        let visible = lg[0..., 0..., 0] .> -Float.infinity  // (B, Hk, L, N)
        let seen = visible.asType(.float32).sum(axis: 2)  // (B, Hk, N)
        let probs = { exp(lg - lse.reshaped(B, Hk, Hq / Hk, L, 1)) }
        let newScore: MLXArray
        switch mode {
        case .ema, .attentionEma:
            let mag =
                mode == .ema
                ? which(expandedDimensions(visible, axis: 2), abs(lg), MLXArray(Float(0)))
                : probs()
            let step = mag.mean(axis: 2).sum(axis: 2) / maximum(seen, MLXArray(Float(1)))
            let ema = which(
                count .> Float(0), Float(alpha) * score + Float(1.0 - alpha) * step, step)
            newScore = which(seen .> Float(0), ema, score)
        case .accumulated, .normalized:
            newScore = score + probs().mean(axis: 2).sum(axis: 2)
        }
        return (newScore, count + seen)
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

    /// (B, n_kv_heads, k) slots of the k highest keys, in position order.
    public static func selectKeep(priorities: MLXArray, positions: MLXArray, k: Int) -> MLXArray {
        let keys = orderKeys(priorities: priorities, positions: positions)
        let n = keys.dim(-1)
        let top = argSort(keys, axis: -1)[.ellipsis, (n - k)...]
        let order = argSort(takeAlong(positions, top, axis: -1), axis: -1)
        return takeAlong(top, order, axis: -1)
    }
}
