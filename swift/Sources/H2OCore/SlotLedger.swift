// Scalar slot bookkeeping of an H2O cache (mirrors the counters of
// mlx_h2o/cache/h2o.py), shared by the CPU mirror `H2OSlots` and the MLX cache.

/// Raised when a cache is updated again before the attention of the previous
/// update reported its scores (the model's attention bypassed the H2O route).
public struct H2OScoresMissing: Error, CustomStringConvertible {
    public let modelName: String
    public init(modelName: String = "") { self.modelName = modelName }
    public var description: String {
        let model = modelName.isEmpty ? "" : " (model: \(modelName))"
        return "H2OKVCache.update was called again before the attention of the previous "
            + "call reported its scores. The model's attention does not go through "
            + "attentionWithCacheUpdate with the H2O patch (or h2oAttention), so the "
            + "cache cannot see its scores\(model)."
    }
}

/// Offsets, slot counts and the decision of each step; no per-slot data.
///
/// `offset` counts every token seen (it drives RoPE), never the slots used.
/// Storage is slot based: a decode step with a full cache writes the new token
/// into a victim slot, chunks are appended, attended in full, then compacted
/// once to `maxSize`.
public struct SlotLedger: Equatable, Sendable {
    public let config: H2OConfig
    /// Sliding window of the model's layer (e.g. Gemma 3 local layers), if any.
    public let windowSize: Int?
    public internal(set) var offset = 0
    /// Tokens evicted per (sequence, KV head).
    public internal(set) var evicted = 0
    /// Slots in use.
    public internal(set) var size = 0
    /// Slots allocated in the storage.
    public internal(set) var capacity = 0
    public internal(set) var awaitingScores = false

    public init(config: H2OConfig, windowSize: Int? = nil) throws {
        if let windowSize, windowSize < 1 {
            throw H2OConfigError("window_size must be >= 1, got \(windowSize)")
        }
        self.config = config
        self.windowSize = windowSize
    }

    /// What an update of `length` tokens does to the storage.
    public enum Update: Equatable, Sendable {
        /// Write the tokens into `slots`; first grow the storage to `growTo` slots
        /// (keeping the first `slots.lowerBound`) when set.
        case append(slots: Range<Int>, growTo: Int?)
        /// Decode with a full cache: write the token into each row's victim, the
        /// lowest order key at priorities for `priorityOffset` tokens seen.
        case replaceVictim(priorityOffset: Int)
    }

    /// Plans an update of `length` new tokens and advances the counters.
    public mutating func update(length: Int, modelName: String = "") throws -> Update {
        if awaitingScores { throw H2OScoresMissing(modelName: modelName) }
        precondition(length >= 1, "an update needs at least one token")
        let plan: Update
        if length == 1 && size >= config.maxSize {
            plan = .replaceVictim(priorityOffset: offset + 1)
            evicted += 1
        } else {
            let need = size + length
            var growTo: Int? = nil
            if need > capacity {
                // Grow in steps up to maxSize; a chunk past the budget gets exact room.
                let stepped = (need + config.step - 1) / config.step * config.step
                growTo = need <= config.maxSize ? min(stepped, config.maxSize) : need
                capacity = growTo!
            }
            plan = .append(slots: size ..< need, growTo: growTo)
            size = need
        }
        offset += length
        awaitingScores = true
        return plan
    }

    /// Records that the scores of the last update were folded in. Returns the
    /// number of slots to keep when the chunk overflowed `maxSize` (compaction
    /// at priorities for the current `offset`), else nil.
    public mutating func scoresFolded() -> Int? {
        awaitingScores = false
        guard size > config.maxSize else { return nil }
        evicted += size - config.maxSize
        size = config.maxSize
        capacity = config.maxSize
        return config.maxSize
    }

    /// What a trim does to the storage.
    public enum Trim: Equatable, Sendable {
        /// Nothing evicted yet: slots are in token order, drop the last `count`.
        case truncate(count: Int)
        /// After eviction the trimmed tokens sit anywhere: every row drops its
        /// positions from `cut` on and keeps its best slots, as many as the
        /// fewest any row has left (then call ``regathered(size:)``).
        case regather(count: Int, cut: Int)
    }

    /// Forgets the newest `n` tokens (those still held), at any point.
    public mutating func trim(_ n: Int) -> Trim {
        let count = max(0, min(n, offset))
        awaitingScores = false
        guard count > 0 else { return .truncate(count: 0) }
        offset -= count
        if evicted > 0 { return .regather(count: count, cut: offset) }
        size -= count
        return .truncate(count: count)
    }

    /// Records the slots a ``Trim/regather(count:cut:)`` kept in every row.
    public mutating func regathered(size: Int) {
        self.size = size
        capacity = size
        evicted = offset - size
    }

    /// Restores the counters of a saved cache holding `size` slots.
    public mutating func restore(offset: Int, evicted: Int, size: Int) {
        self.offset = offset
        self.evicted = evicted
        self.size = size
        self.capacity = size
        self.awaitingScores = false
    }

    /// How the attention of an update of `queries` tokens is masked.
    public enum MaskKind: Equatable, Sendable {
        /// Every slot is visible (decode without a window).
        case none
        /// Bottom-right causal over the slot order (new tokens are the last slots).
        case causal
        /// From positions: key k is visible to query q when q - window < k <= q.
        case window
    }

    /// The mask of the attention right after an update of `queries` tokens.
    public func maskKind(queries: Int) -> MaskKind {
        guard let windowSize, !(queries == 1 && offset <= windowSize) else {
            return queries == 1 ? .none : .causal
        }
        return .window
    }
}
