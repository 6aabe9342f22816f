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

    /// Parses a mode name, with the Python package's error for an unknown one.
    public init(name: String) throws {
        guard let mode = ScoreMode(rawValue: name) else {
            let modes = ScoreMode.allCases.map { "'\($0.rawValue)'" }.joined(separator: ", ")
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
/// (heavy gets the extra). `pinned` holds half-open position ranges that are
/// never evicted; they use heavy-hitter slots.
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
    /// > 0: a chunk of L > 1 tokens (a prompt) is scored by its last
    /// `prefillWindow` queries only (SnapKV, Li et al. 2024).
    public let prefillWindow: Int
    /// > 1: a chunk's scores are max-pooled over that many neighbouring
    /// positions, so the tokens around an attended one stay with it.
    public let prefillPool: Int

    public init(
        maxSize: Int, sinkSize: Int = 4, heavyBudget: Int? = nil, recentBudget: Int? = nil,
        score: ScoreMode = .accumulated, emaAlpha: Double = 0.95, pinned: [Range<Int>] = [],
        step: Int = 256, prefillWindow: Int = 32, prefillPool: Int = 11
    ) throws {
        try checkInt("max_size", maxSize, 1)
        try checkInt("sink_size", sinkSize, 0)
        try checkInt("step", step, 1)
        try checkInt("prefill_window", prefillWindow, 0)
        try checkInt("prefill_pool", prefillPool, 0)
        let (heavy, recent) = try split(maxSize, sinkSize, heavyBudget, recentBudget)
        guard emaAlpha > 0, emaAlpha < 1 else {
            throw H2OConfigError("ema_alpha must be in (0, 1), got \(emaAlpha)")
        }
        self.maxSize = maxSize
        self.sinkSize = sinkSize
        self.heavyBudget = heavy
        self.recentBudget = recent
        self.score = score
        self.emaAlpha = emaAlpha
        self.pinned = try checkPinned(pinned, heavy: heavy)
        self.step = step
        self.prefillWindow = prefillWindow
        self.prefillPool = prefillPool
    }

    /// Number of pinned positions.
    public var pinnedCount: Int { pinned.reduce(0) { $0 + $1.count } }
}

/// Pinned ranges from `[start, end]` pairs (the JSON form), rejecting bad pairs
/// with the Python package's messages.
public func pinnedRanges(_ pairs: [[Int]]) throws -> [Range<Int>] {
    try pairs.map { pair in
        guard pair.count == 2, pair[0] < pair[1] else {
            let shown = "(" + pair.map(String.init).joined(separator: ", ") + ")"
            throw H2OConfigError(
                "pinned range \(shown) must be (start, end) ints with start < end")
        }
        return pair[0] ..< pair[1]
    }
}

private func checkInt(_ name: String, _ value: Int, _ lowest: Int) throws {
    if value < lowest {
        throw H2OConfigError("\(name) must be >= \(lowest), got \(value)")
    }
}

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
    let h: Int
    let r: Int
    switch (heavy, recent) {
    case (nil, nil): (h, r) = (rest - rest / 2, rest / 2)
    case (nil, let recent?): (h, r) = (rest - recent, recent)
    case (let heavy?, nil): (h, r) = (heavy, rest - heavy)
    case (let heavy?, let recent?): (h, r) = (heavy, recent)
    }
    if h < 0 || r < 0 || sink + h + r != maxSize {
        throw H2OConfigError(
            "sink_size + heavy_budget + recent_budget = \(sink) + \(h) + \(r)"
                + " must equal max_size=\(maxSize): leave one budget unset to derive it")
    }
    if r < 1 {
        throw H2OConfigError(
            "recent_budget must be >= 1: the newest token must stay in the cache")
    }
    return (h, r)
}

private func checkPinned(_ pinned: [Range<Int>], heavy: Int) throws -> [Range<Int>] {
    let show = { (r: Range<Int>) in "(\(r.lowerBound), \(r.upperBound))" }
    for r in pinned {
        if r.isEmpty {
            throw H2OConfigError(
                "pinned range \(show(r)) must be (start, end) ints with start < end")
        }
        if r.lowerBound < 0 {
            throw H2OConfigError("pinned range \(show(r)) starts before position 0")
        }
    }
    let ranges = pinned.sorted { ($0.lowerBound, $0.upperBound) < ($1.lowerBound, $1.upperBound) }
    for (a, b) in zip(ranges, ranges.dropFirst()) where b.lowerBound < a.upperBound {
        let shown = "[" + ranges.map(show).joined(separator: ", ") + "]"
        throw H2OConfigError("pinned ranges overlap: \(shown)")
    }
    let count = ranges.reduce(0) { $0 + $1.count }
    if count > heavy {
        throw H2OConfigError(
            "\(count) pinned positions exceed heavy_budget=\(heavy): "
                + "pinned tokens use heavy-hitter slots; raise heavy_budget")
    }
    return ranges
}
