// The scores one attention call exports, as plain arrays (the CPU side of
// `scaled_dot_product_attention_with_scores`).

/// Logits and log-sum-exp of one attention call.
///
/// Shapes: `logits` (B, n_heads, L, N) row-major, `scale * q.k` (+ mask), masked
/// entries `-inf`, exactly what the softmax consumed; `lse` (B, n_heads, L), so
/// the probabilities are `exp(logit - lse)`. N follows the cache's slot order.
public struct AttentionScores: Sendable {
    public let batchSize: Int
    public let heads: Int
    public let queries: Int
    public let keys: Int
    public let logits: [Float]
    public let lse: [Float]

    public init(
        batchSize: Int, heads: Int, queries: Int, keys: Int, logits: [Float], lse: [Float]
    ) throws {
        guard batchSize * heads * queries * keys == logits.count,
            batchSize * heads * queries == lse.count
        else {
            throw H2OShapeError(
                "logits has \(logits.count) values and lse \(lse.count); expected "
                    + "(B, n_heads, L, N) = (\(batchSize), \(heads), \(queries), \(keys))")
        }
        self.batchSize = batchSize
        self.heads = heads
        self.queries = queries
        self.keys = keys
        self.logits = logits
        self.lse = lse
    }

    @inline(__always)
    func logit(_ b: Int, _ h: Int, _ l: Int, _ j: Int) -> Float {
        logits[((b * heads + h) * queries + l) * keys + j]
    }

    @inline(__always)
    func logSumExp(_ b: Int, _ h: Int, _ l: Int) -> Float {
        lse[(b * heads + h) * queries + l]
    }
}

/// Arrays whose shapes do not fit the cache.
public struct H2OShapeError: Error, Equatable, CustomStringConvertible {
    public let message: String
    public init(_ message: String) { self.message = message }
    public var description: String { message }
}
