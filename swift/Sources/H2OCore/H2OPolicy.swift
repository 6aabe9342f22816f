// H2O policy on plain arrays: score folding and victim selection
// (mirrors mlx_h2o/policy.py, one (sequence, KV head) row at a time).

import Foundation

/// Score accumulation and the exact eviction order.
///
/// Selection uses a total order so every backend makes the same decision: a
/// slot's key is (priority, position), where priority is +inf for protected
/// slots (sinks, recent window, pinned), -inf for slots a sliding-window layer
/// can no longer see, else the eviction score. Ties in score evict the older
/// position first.
public enum H2OPolicy {

    /// Folds one attention call into the running scores of row (`batch`, `kvHead`).
    ///
    /// Shapes: `score`, `count`, `positions` (N) for this row; `scores.logits`
    /// (B, n_heads, L, N). The query heads of the KV head's group are averaged;
    /// `count` gains the number of queries that could see each key (visibility
    /// from the group's first head: masks are shared within a GQA group).
    /// `window` > 0 folds only the last `window` queries; `pool` > 1 max-pools a
    /// chunk's (L > 1) contribution over keys within `pool / 2` positions.
    /// Float32 arithmetic in the order of the MLX ops (mean over heads as sum
    /// times 1/G, then sum over queries).
    public static func foldScores(
        mode: ScoreMode, score: inout [Float], count: inout [Float], scores s: AttentionScores,
        batch b: Int, kvHead h: Int, kvHeads: Int, alpha: Double, window: Int = 0,
        positions: [Int32]? = nil, pool: Int = 0
    ) {
        let G = s.heads / kvHeads
        let invG = Float(1.0 / Double(G))
        let queries = (0 < window && window < s.queries) ? (s.queries - window) ..< s.queries : 0 ..< s.queries
        var step = [Float](repeating: 0, count: s.keys)
        var seen = [Float](repeating: 0, count: s.keys)
        for j in 0 ..< s.keys {
            for l in queries {
                let visible = s.logit(b, h * G, l, j) > -Float.infinity
                if visible { seen[j] += 1 }
                var group: Float = 0
                for g in h * G ..< (h + 1) * G {
                    let x = s.logit(b, g, l, j)
                    group += mode == .ema ? (visible ? Swift.abs(x) : 0) : Foundation.exp(x - s.logSumExp(b, g, l))
                }
                step[j] += group * invG
            }
        }
        if pool > 1 && s.queries > 1, let positions {
            step = poolNeighbours(step, positions: positions, radius: pool / 2)
        }
        let (a, oneMinusA) = (Float(alpha), Float(1.0 - alpha))
        for j in 0 ..< s.keys {
            switch mode {
            case .ema, .attentionEma:
                let st = step[j] / Swift.max(seen[j], 1)
                let ema = count[j] > 0 ? a * score[j] + oneMinusA * st : st
                if seen[j] > 0 { score[j] = ema }
            case .accumulated, .normalized:
                score[j] = score[j] + step[j]
            case .tova:
                if seen[j] > 0 { score[j] = step[j] / Swift.max(seen[j], 1) }
            }
            count[j] = count[j] + seen[j]
        }
    }

    /// Whether a prompt chunk of `chunk` tokens that leaves the cache over its
    /// budget, arriving while `before` tokens are already held, replaces every
    /// held slot's score and count with its own window's instead of adding to
    /// them (mirrors `policy.window_replaces`).
    ///
    /// It does when the chunk is scored by a full window (0 < `prefillWindow`
    /// <= `chunk`) and the cache already held `maxSize` tokens: what it holds
    /// was chosen before (by an earlier window or by decode steps), and the
    /// newest window, the one nearest the question, alone decides; added to the
    /// earlier windows' scores, a long prompt's filler would keep ranking it.
    /// The first chunk to overflow (`before < maxSize`) adds to what the chunks
    /// that fitted gave, so a prompt prefilled in one chunk is unaffected.
    /// (Python's key-norm modes, never replaced, do not exist here.)
    public static func windowReplaces(config: H2OConfig, chunk: Int, before: Int) -> Bool {
        0 < config.prefillWindow && config.prefillWindow <= chunk && before >= config.maxSize
    }

    /// Max of `x` (>= 0) over the slots whose positions lie within `radius`.
    /// Neighbours are looked up by slot offset and kept only where the positions
    /// differ by exactly that offset (after an eviction slots are not in order).
    public static func poolNeighbours(_ x: [Float], positions: [Int32], radius: Int) -> [Float] {
        var out = x
        for d in 1 ... Swift.max(radius, 1) where radius >= 1 && d < x.count {
            for j in x.indices {
                if j + d < x.count && Int(positions[j + d]) - Int(positions[j]) == d {
                    out[j] = Swift.max(out[j], x[j + d])
                }
                if j - d >= 0 && Int(positions[j]) - Int(positions[j - d]) == d {
                    out[j] = Swift.max(out[j], x[j - d])
                }
            }
        }
        return out
    }

    /// The number that ranks tokens: higher is kept.
    @inline(__always)
    public static func evictionScore(mode: ScoreMode, score: Float, count: Float) -> Float {
        mode == .normalized ? score / Swift.max(count, 1) : score
    }

    /// Whether `position` is never evicted, given `offset` tokens seen (incl. new ones).
    public static func isProtected(position: Int32, offset: Int, config: H2OConfig) -> Bool {
        let p = Int(position)
        if p < config.sinkSize || p >= offset - config.recentBudget { return true }
        return config.pinned.contains { $0.contains(p) }
    }

    /// Eviction priority: +inf protected, -inf outside a sliding window, else `score`.
    public static func priority(
        score: Float, protected: Bool, position: Int32, offset: Int, windowSize: Int?
    ) -> Float {
        // The newest query sits at offset - 1; older keys are invisible to it.
        if let windowSize, Int(position) <= offset - 1 - windowSize { return -.infinity }
        return protected ? .infinity : score
    }

    /// `priority` with protected slots other than sinks just below the sinks,
    /// for a selection that may keep fewer slots than the protected zones hold.
    public static func sinksFirst(priority: Float, position: Int32, sinkSize: Int) -> Float {
        guard priority == .infinity else { return priority }
        return Int(position) < sinkSize ? .infinity : .greatestFiniteMagnitude
    }

    /// A unique key ordering slots by (priority, position): an order-preserving
    /// map of the float's bits in the high word, the position in the low word.
    @inline(__always)
    public static func orderKey(priority: Float, position: Int32) -> Int64 {
        let bits = Int32(bitPattern: (priority + 0.0).bitPattern)  // + 0.0 folds -0 into 0
        let ordered = bits >= 0 ? bits : bits ^ 0x7FFF_FFFF
        return Int64(ordered) * (1 << 32) + Int64(position)
    }

    /// The slot with the lowest (priority, position).
    public static func selectVictim(priorities: [Float], positions: [Int32]) -> Int {
        precondition(!priorities.isEmpty && priorities.count == positions.count)
        var best = 0
        var bestKey = orderKey(priority: priorities[0], position: positions[0])
        for i in 1 ..< priorities.count {
            let key = orderKey(priority: priorities[i], position: positions[i])
            if key < bestKey { (best, bestKey) = (i, key) }
        }
        return best
    }

    /// The `k` slots with the highest (priority, position), in position order.
    public static func selectKeep(priorities: [Float], positions: [Int32], k: Int) -> [Int] {
        precondition(priorities.count == positions.count && k <= priorities.count)
        let keys = zip(priorities, positions).map { orderKey(priority: $0, position: $1) }
        let top = keys.indices.sorted { keys[$0] < keys[$1] }.suffix(k)
        return top.sorted { positions[$0] < positions[$1] }
    }
}
