// Budget split and scoring of an H2O KV cache (mirrors mlx_h2o/config.py).

/// How a slot's score accumulates; see ``H2OPolicy/foldScores(mode:score:count:scores:row:alpha:)``.
public enum ScoreMode: String, Sendable, CaseIterable, Codable {
    /// EMA of |logit| over attention calls (the H2O-in-MLX paper):
    /// `s = alpha * s + (1 - alpha) * mean_q |logit|`; the first sight sets `s`.
    case ema
    /// Sum of softmax attention over all queries (original H2O, Zhang et al. 2023).
    case accumulated
    /// Accumulated attention divided by the number of queries that could see the key.
    case normalized
    /// EMA of softmax attention (`ema` with the probability in place of |logit|:
    /// a large negative logit is no reason to keep a key).
    case attentionEma = "attention_ema"
    /// TOVA (Oren et al. 2024): the softmax attention of the last call alone,
    /// averaged over its queries that saw the key; earlier calls forgotten.
    case tova

    /// Modes of the Python package this core does not implement (it refuses
    /// them by name): `key_norm` scores a slot by its key's L2 norm when the key
    /// is written, and `expected_attention` scores a prompt chunk from its
    /// queries' mean and covariance; these slots see logits only.
    public static let pythonOnly = ["key_norm", "expected_attention"]

    /// Parses a mode name, with the Python package's error for an unknown one.
    public init(name: String) throws {
        guard let mode = ScoreMode(rawValue: name) else {
            let ours = ScoreMode.allCases.map { "'\($0.rawValue)'" }.joined(separator: ", ")
            if ScoreMode.pythonOnly.contains(name) {
                throw H2OConfigError(
                    "score='\(name)' runs in the Python package only, not in the Swift "
                        + "port; use one of (\(ours))")
            }
            let all = ScoreMode.allCases.map(\.rawValue) + ScoreMode.pythonOnly
            let modes = all.map { "'\($0)'" }.joined(separator: ", ")
            throw H2OConfigError("score='\(name)' is not a score mode; use one of (\(modes))")
        }
        self = mode
    }
}

/// A rejected configuration; `message` is the Python package's `ValueError` text.
public struct H2OConfigError: Error, Equatable, CustomStringConvertible {
    public let message: String
    public init(_ message: String) { self.message = message }
    public var description: String { message }
}

/// Budget split and scoring of an H2O KV cache.
///
/// The cache keeps at most `maxSize` tokens per layer: the first `sinkSize`
/// positions (attention sinks), the last `recentBudget` positions (recent window)
/// and the `heavyBudget` other tokens with the highest score (heavy hitters);
/// `maxSize = sink + heavy + recent`. Leave `heavyBudget` or `recentBudget` (or
/// both) `nil` to derive it: with both unset the remainder is split in half
/// (heavy gets the extra; the recent window gets at least 1 slot, so heavy may
/// be 0). `pinned` holds half-open position ranges that are never evicted; they
/// use heavy-hitter slots. Checks run in the Python package's order, each
/// throwing its message.
public struct H2OConfig: Equatable, Sendable {
    public let maxSize: Int
    public let sinkSize: Int
    public let heavyBudget: Int
    public let recentBudget: Int
    public let score: ScoreMode
    public let emaAlpha: Double
    /// Sorted, non-overlapping half-open ranges.
    public let pinned: [Range<Int>]
    /// Slots the storage grows by, up to `maxSize`.
    public let step: Int
    /// > 0: a chunk of L > 1 tokens (a prompt) that overflows the budget is
    /// scored by its last `prefillWindow` queries only (SnapKV, Li et al. 2024);
    /// a later one of L >= `prefillWindow` on a full cache replaces the held
    /// slots' scores with its window's (`H2OPolicy.windowReplaces`).
    public let prefillWindow: Int
    /// > 1: a chunk's scores are max-pooled over that many neighbouring
    /// positions, so the tokens around an attended one stay with it.
    public let prefillPool: Int

    public init(
        maxSize: Int, sinkSize: Int = 4, heavyBudget: Int? = nil, recentBudget: Int? = nil,
        score: ScoreMode = .accumulated, emaAlpha: Double = 0.95, pinned: [Range<Int>] = [],
        step: Int = 256, prefillWindow: Int = 32, prefillPool: Int = 21
    ) throws {
        try checkInt("max_size", maxSize, 1)
        try checkInt("sink_size", sinkSize, 0)
        let (heavy, recent) = try split(maxSize, sinkSize, heavyBudget, recentBudget)
        guard emaAlpha > 0, emaAlpha < 1 else {  // NaN fails too
            throw H2OConfigError(
                "ema_alpha must be in (0, 1), got \(emaAlpha): e.g. ema_alpha=0.95")
        }
        let pinned = try checkPinned(pinned, heavy: heavy)
        try checkInt("step", step, 1)
        try checkInt("prefill_window", prefillWindow, 0)
        try checkInt("prefill_pool", prefillPool, 0)
        self.maxSize = maxSize
        self.sinkSize = sinkSize
        self.heavyBudget = heavy
        self.recentBudget = recent
        self.score = score
        self.emaAlpha = emaAlpha
        self.pinned = pinned
        self.step = step
        self.prefillWindow = prefillWindow
        self.prefillPool = prefillPool
    }

    /// Number of pinned positions.
    public var pinnedCount: Int { pinned.reduce(0) { $0 + $1.count } }
}

/// Pinned ranges from `[start, end]` pairs (the JSON form), rejecting bad pairs
/// with the Python package's messages (each pair checked in order, as Python does).
public func pinnedRanges(_ pairs: [[Int]]) throws -> [Range<Int>] {
    try pairs.map { pair in
        guard pair.count == 2 else {
            let all = pythonTuple(pairs.map { pythonTuple($0.map(String.init)) })
            throw H2OConfigError(
                "pinned must be a tuple of (start, end) int pairs; "
                    + "\(pythonTuple(pair.map(String.init))) in pinned=\(all) is not one "
                    + "(one range: pinned=((start, end),))")
        }
        let shown = "(\(pair[0]), \(pair[1]))"
        if pair[0] >= pair[1] { throw pinnedOrderError(shown) }
        if pair[0] < 0 { throw pinnedStartError(shown) }
        return pair[0] ..< pair[1]
    }
}

/// Python's `repr` of a tuple of already-shown items: `(a, b)`, `(a,)`, `()`.
private func pythonTuple(_ items: [String]) -> String {
    items.count == 1 ? "(\(items[0]),)" : "(" + items.joined(separator: ", ") + ")"
}

private func pinnedOrderError(_ shown: String) -> H2OConfigError {
    H2OConfigError(
        "pinned range \(shown) must be (start, end) with start < end: "
            + "write it as (first position, last position + 1)")
}

private func pinnedStartError(_ shown: String) -> H2OConfigError {
    H2OConfigError("pinned range \(shown) starts before position 0: start it at >= 0")
}

private func checkInt(_ name: String, _ value: Int, _ lowest: Int) throws {
    if value < lowest {
        throw H2OConfigError("\(name) must be >= \(lowest), got \(value): use \(name) >= \(lowest)")
    }
}

/// (heavy, recent) with `sink + heavy + recent == maxSize`; unset budgets are
/// derived (both unset: recent gets half of the rest, at least 1).
private func split(_ maxSize: Int, _ sink: Int, _ heavy: Int?, _ recent: Int?) throws
    -> (Int, Int)
{
    if let heavy { try checkInt("heavy_budget", heavy, 0) }
    if let recent { try checkInt("recent_budget", recent, 0) }
    if sink >= maxSize {
        throw H2OConfigError(
            "sink_size=\(sink) leaves no room in max_size=\(maxSize): "
                + "use a sink_size smaller than max_size")
    }
    let rest = maxSize - sink
    if let heavy, let recent, sink + heavy + recent != maxSize {
        throw H2OConfigError(
            "sink_size + heavy_budget + recent_budget = \(sink) + \(heavy) + \(recent)"
                + " must equal max_size=\(maxSize): leave one budget unset to derive it")
    }
    if let recent, recent < 1 {
        throw H2OConfigError(
            "recent_budget must be >= 1, got \(recent): the newest token must stay "
                + "in the cache; leave it unset to derive it")
    }
    if let recent, recent > rest {
        throw H2OConfigError(
            "recent_budget=\(recent) exceeds max_size - sink_size = \(rest): use "
                + "recent_budget <= \(rest), or leave it unset")
    }
    if let heavy, heavy >= rest {
        throw H2OConfigError(
            "recent_budget must be >= 1 (the newest token must stay in the cache), "
                + "but heavy_budget=\(heavy) leaves max_size - sink_size - heavy_budget = "
                + "\(rest - heavy): use heavy_budget <= \(rest - 1), or leave it unset")
    }
    let r = recent ?? heavy.map { rest - $0 } ?? max(rest / 2, 1)
    return (rest - r, r)
}

private func checkPinned(_ pinned: [Range<Int>], heavy: Int) throws -> [Range<Int>] {
    let show = { (r: Range<Int>) in "(\(r.lowerBound), \(r.upperBound))" }
    for r in pinned {
        if r.isEmpty { throw pinnedOrderError(show(r)) }
        if r.lowerBound < 0 { throw pinnedStartError(show(r)) }
    }
    let ranges = pinned.sorted { ($0.lowerBound, $0.upperBound) < ($1.lowerBound, $1.upperBound) }
    let shown = "[" + ranges.map(show).joined(separator: ", ") + "]"
    for (a, b) in zip(ranges, ranges.dropFirst()) where b.lowerBound < a.upperBound {
        throw H2OConfigError("pinned ranges overlap: \(shown); merge them into one range")
    }
    let count = ranges.reduce(0) { $0 + $1.count }
    if count > heavy {
        throw H2OConfigError(
            "pinned ranges \(shown) hold \(count) positions, which exceed "
                + "heavy_budget=\(heavy): pinned tokens use heavy-hitter slots; "
                + "raise heavy_budget")
    }
    return ranges
}
