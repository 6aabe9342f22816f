// CPU mirror of H2OKVCache's slot logic: positions, scores and counts per
// (sequence, KV head) row, no tensor data. The parity vectors replay it.

/// The slot bookkeeping of an H2O cache on plain arrays.
///
/// Rows are indexed `b * kvHeads + h`; every row has `size` slots. Drive it like
/// the cache: ``update(batchSize:kvHeads:length:)`` then ``fold(_:)`` with the
/// scores of the attention over the slots, or ``trim(_:)``.
public struct H2OSlots: Sendable {
    public private(set) var ledger: SlotLedger
    public private(set) var batchSize = 0
    public private(set) var kvHeads = 0
    /// Token position held by each slot, per row.
    public private(set) var positions: [[Int32]] = []
    public private(set) var score: [[Float]] = []
    /// Queries that could see each slot's token so far, per row.
    public private(set) var count: [[Float]] = []
    /// Victim slot of each row in the last decode step that evicted, else nil.
    public private(set) var lastVictims: [Int]? = nil

    public init(config: H2OConfig, windowSize: Int? = nil) throws {
        ledger = try SlotLedger(config: config, windowSize: windowSize)
    }

    public var config: H2OConfig { ledger.config }
    public var offset: Int { ledger.offset }
    public var size: Int { ledger.size }

    /// Adds `length` tokens (positions `offset ..< offset + length`) to every row.
    public mutating func update(batchSize: Int, kvHeads: Int, length: Int) throws {
        if !positions.isEmpty && (batchSize != self.batchSize || kvHeads != self.kvHeads) {
            throw H2OShapeError(
                "update with (B, n_kv_heads) = (\(batchSize), \(kvHeads)) on a cache of "
                    + "(\(self.batchSize), \(self.kvHeads))")
        }
        if positions.isEmpty {
            (self.batchSize, self.kvHeads) = (batchSize, kvHeads)
            let rows = batchSize * kvHeads
            (positions, score, count) = (.init(repeating: [], count: rows),
                .init(repeating: [], count: rows), .init(repeating: [], count: rows))
        }
        let start = Int32(ledger.offset)
        switch try ledger.update(length: length) {
        case .append:
            let new = (0 ..< Int32(length)).map { start + $0 }
            for r in positions.indices {
                positions[r] += new
                score[r] += Array(repeating: 0, count: length)
                count[r] += Array(repeating: 0, count: length)
            }
            lastVictims = nil
        case .replaceVictim(let priorityOffset):
            let pri = priorities(offset: priorityOffset)
            var victims = [Int]()
            for r in positions.indices {
                let v = H2OPolicy.selectVictim(priorities: pri[r], positions: positions[r])
                (positions[r][v], score[r][v], count[r][v]) = (start, 0, 0)
                victims.append(v)
            }
            lastVictims = victims
        }
    }

    /// Folds the scores of the attention over the current slots, then compacts
    /// an overflowing chunk to `maxSize`.
    public mutating func fold(_ scores: AttentionScores) throws {
        guard scores.batchSize == batchSize, scores.keys == size,
            kvHeads > 0, scores.heads % kvHeads == 0
        else {
            throw H2OShapeError(
                "scores (B, n_heads, L, N) = (\(scores.batchSize), \(scores.heads), "
                    + "\(scores.queries), \(scores.keys)) do not fit \(batchSize) sequences, "
                    + "\(kvHeads) KV heads, \(size) slots")
        }
        // Only a chunk that overflows the budget is scored by its window (SnapKV).
        let over = size > config.maxSize
        if over && H2OPolicy.windowReplaces(
            config: config, chunk: scores.queries, before: size - scores.queries)
        {
            // A later chunk on a full cache: its window alone decides.
            score = score.map { Array(repeating: 0, count: $0.count) }
            count = count.map { Array(repeating: 0, count: $0.count) }
        }
        for b in 0 ..< batchSize {
            for h in 0 ..< kvHeads {
                let r = b * kvHeads + h
                H2OPolicy.foldScores(
                    mode: config.score, score: &score[r], count: &count[r], scores: scores,
                    batch: b, kvHead: h, kvHeads: kvHeads, alpha: config.emaAlpha,
                    window: over ? config.prefillWindow : 0, positions: positions[r],
                    pool: over ? config.prefillPool : 0)
            }
        }
        let offset = ledger.offset
        if let k = ledger.scoresFolded() {
            let pri = priorities(offset: offset)
            gather(positions.indices.map {
                H2OPolicy.selectKeep(priorities: pri[$0], positions: positions[$0], k: k)
            })
        }
    }

    /// Drops the newest `n` tokens; returns how many were dropped.
    @discardableResult
    public mutating func trim(_ n: Int) -> Int {
        switch ledger.trim(n) {
        case .truncate(let k):
            for r in positions.indices {
                positions[r].removeLast(k)
                score[r].removeLast(k)
                count[r].removeLast(k)
            }
            return k
        case .regather(let k, let cut):
            // Each row's held positions below the cut, the best of them kept.
            let held = positions.map { row in row.indices.filter { Int(row[$0]) < cut } }
            let size = held.map(\.count).min() ?? 0
            let pri = priorities(offset: cut)
            gather(positions.indices.map { r in
                let rank = held[r].map {
                    H2OPolicy.sinksFirst(
                        priority: pri[r][$0], position: positions[r][$0], sinkSize: config.sinkSize)
                }
                let keep = H2OPolicy.selectKeep(
                    priorities: rank, positions: held[r].map { positions[r][$0] }, k: size)
                return keep.map { held[r][$0] }
            })
            ledger.regathered(size: size)
            return k
        }
    }

    /// Eviction priorities of every row for `offset` tokens seen.
    public func priorities(offset: Int) -> [[Float]] {
        positions.indices.map { r in
            positions[r].indices.map { j in
                let p = positions[r][j]
                return H2OPolicy.priority(
                    score: H2OPolicy.evictionScore(
                        mode: config.score, score: score[r][j], count: count[r][j]),
                    protected: H2OPolicy.isProtected(position: p, offset: offset, config: config),
                    position: p, offset: offset, windowSize: ledger.windowSize)
            }
        }
    }

    /// Visibility (L, size) of each row's slots to the `queries` newest tokens,
    /// for a window layer; nil where the mask is `none` or `causal`.
    public func windowMask(queries: Int) -> [[[Bool]]]? {
        guard ledger.maskKind(queries: queries) == .window, let window = ledger.windowSize
        else { return nil }
        return positions.map { row in
            (ledger.offset - queries ..< ledger.offset).map { q in
                row.map { Int($0) <= q && Int($0) > q - window }
            }
        }
    }

    private mutating func gather(_ slots: [[Int]]) {
        for r in positions.indices {
            positions[r] = slots[r].map { positions[r][$0] }
            score[r] = slots[r].map { score[r][$0] }
            count[r] = slots[r].map { count[r][$0] }
        }
    }
}
