// H2OConfig as the Python package's `config_to_dict` JSON, so a cache's
// metaState (and saved prompt caches) read the same in Swift and Python.

import Foundation

extension H2OConfig {

    /// Builds a config from `config_to_dict` keys (`max_size`, `sink_size`,
    /// `heavy_budget`, `recent_budget`, `score`, `ema_alpha`, `pinned`, `step`,
    /// `prefill_window`, `prefill_pool`); missing keys take the defaults.
    /// `prefill_compact` (Python writes it only when not "chunk") must be "chunk",
    /// "preview" or "two_pass": the Swift cache compacts every prefill chunk that
    /// overflows the budget, and without a preview pass (the Swift port has none)
    /// "preview" and "two_pass" are exactly that.
    /// `evict_batch` (written only when not 1) must be 1: the Swift cache
    /// evicts one token per decode step.
    public init(dictionary d: [String: Any]) throws {
        if let compact = d["prefill_compact"],
            !["chunk", "preview", "two_pass"].contains(compact as? String)
        {
            throw H2OConfigError(
                "prefill_compact=\(compact) is not supported by the Swift port; it compacts "
                    + "each prefill chunk that overflows the budget ('chunk', or 'preview' "
                    + "and 'two_pass' without a preview)")
        }
        if let batch = d["evict_batch"], (batch as? Int) != 1 {
            throw H2OConfigError(
                "evict_batch=\(batch) is not supported by the Swift port; it evicts one "
                    + "token per decode step (evict_batch=1)")
        }
        func int(_ key: String) throws -> Int? {
            guard let v = d[key], !(v is NSNull) else { return nil }
            if let i = v as? Int { return i }  // an NSNumber holding 8.5 does not bridge
            throw H2OConfigError("\(key) must be an int, got \(type(of: v))")
        }
        guard let maxSize = try int("max_size") else {
            throw H2OConfigError("max_size is required")
        }
        let score = try ScoreMode(name: d["score"] as? String ?? "accumulated")
        let alpha = (d["ema_alpha"] as? NSNumber)?.doubleValue ?? 0.95
        let pairs = (d["pinned"] as? [[Any]] ?? []).map { $0.map { ($0 as? NSNumber)?.intValue ?? -1 } }
        try self.init(
            maxSize: maxSize, sinkSize: try int("sink_size") ?? 4,
            heavyBudget: try int("heavy_budget"), recentBudget: try int("recent_budget"),
            score: score, emaAlpha: alpha, pinned: try pinnedRanges(pairs),
            step: try int("step") ?? 256, prefillWindow: try int("prefill_window") ?? 32,
            prefillPool: try int("prefill_pool") ?? 21)
    }

    /// Parses `json.dumps(config_to_dict(config))`.
    public init(json: String) throws {
        let object = try JSONSerialization.jsonObject(with: Data(json.utf8))
        guard let d = object as? [String: Any] else {
            throw H2OConfigError("config JSON must be an object, got \(json)")
        }
        try self.init(dictionary: d)
    }

    /// The JSON the Python package writes for this config (same keys and order).
    public var json: String {
        let pins = pinned.map { "[\($0.lowerBound), \($0.upperBound)]" }.joined(separator: ", ")
        return "{\"max_size\": \(maxSize), \"sink_size\": \(sinkSize), "
            + "\"heavy_budget\": \(heavyBudget), \"recent_budget\": \(recentBudget), "
            + "\"score\": \"\(score.rawValue)\", \"ema_alpha\": \(emaAlpha), "
            + "\"pinned\": [\(pins)], \"step\": \(step), "
            + "\"prefill_window\": \(prefillWindow), \"prefill_pool\": \(prefillPool)}"
    }
}
