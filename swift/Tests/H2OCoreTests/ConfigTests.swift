// H2OConfig: the Python package's validation rules and messages.

import Foundation
import H2OCore
import H2OVectors
import Testing

@Suite("H2OConfig")
struct ConfigTests {

    /// Every case of config_cases.json: same derived budgets or same error text.
    @Test("validates like mlx_h2o.config.H2OConfig")
    func pythonCases() throws {
        let cases = try Record(Vectors.load("config_cases.json")).records("cases")
        #expect(cases.count >= 15)
        for c in cases {
            let input = c.d["input"] as! [String: Any]
            let result = Result { try H2OConfig(dictionary: input) }
            switch (result, c.d["config"] as? [String: Any], c.d["error"] as? String) {
            case (.success(let config), let want?, nil):
                #expect(config == (try H2OConfig(dictionary: want)), "\(input)")
                #expect(config.json == c.d["json"] as? String, "\(input): metaState JSON")
                #expect(try H2OConfig(json: config.json) == config)
            case (.failure(let error), nil, let message?):
                #expect((error as? H2OConfigError)?.message == message, "\(input)")
            case (let got, _, _):
                Issue.record("\(input): got \(got), want \(c.d)")
            }
        }
    }

    @Test("derives budgets")
    func derivesBudgets() throws {
        let c = try H2OConfig(maxSize: 256, sinkSize: 4, recentBudget: 124)
        #expect((c.heavyBudget, c.recentBudget) == (128, 124))
        let split = try H2OConfig(maxSize: 9, sinkSize: 2)
        #expect((split.heavyBudget, split.recentBudget) == (4, 3))
        let pinned = try H2OConfig(maxSize: 16, sinkSize: 1, recentBudget: 3, pinned: [8 ..< 9, 2 ..< 5])
        #expect(pinned.pinned == [2 ..< 5, 8 ..< 9])
        #expect(pinned.pinnedCount == 4)
        // Both unset: the recent window gets at least 1 slot, heavy may be 0.
        #expect(try H2OConfig(maxSize: 5, sinkSize: 4).heavyBudget == 0)
        #expect(try H2OConfig(maxSize: 5, sinkSize: 4).recentBudget == 1)
        #expect(try H2OConfig(maxSize: 6, sinkSize: 4).heavyBudget == 1)
        #expect(try H2OConfig(maxSize: 5, sinkSize: 4, heavyBudget: 0).recentBudget == 1)
    }

    /// Messages and check order of mlx_h2o/config.py beyond config_cases.json
    /// (the texts Python raises for the same arguments).
    @Test("checks in Python's order, with its messages")
    func pythonOrder() throws {
        func message(_ make: () throws -> Any) -> String? {
            do { _ = try make() } catch { return (error as? H2OConfigError)?.message }
            return nil
        }
        #expect(message { try H2OConfig(maxSize: 8, recentBudget: 0) }
            == "recent_budget must be >= 1, got 0: the newest token must stay in the cache; "
                + "leave it unset to derive it")
        #expect(message { try H2OConfig(maxSize: 8, heavyBudget: 4, recentBudget: 0) }
            == "recent_budget must be >= 1, got 0: the newest token must stay in the cache; "
                + "leave it unset to derive it")
        #expect(message { try H2OConfig(maxSize: 8, recentBudget: 5) }
            == "recent_budget=5 exceeds max_size - sink_size = 4: use recent_budget <= 4, "
                + "or leave it unset")
        #expect(message { try H2OConfig(maxSize: 8, heavyBudget: 4) }
            == "recent_budget must be >= 1 (the newest token must stay in the cache), but "
                + "heavy_budget=4 leaves max_size - sink_size - heavy_budget = 0: use "
                + "heavy_budget <= 3, or leave it unset")
        #expect(message { try H2OConfig(maxSize: 8, heavyBudget: 1, recentBudget: 2) }
            == "sink_size + heavy_budget + recent_budget = 4 + 1 + 2 must equal max_size=8: "
                + "leave one budget unset to derive it")
        #expect(message { try H2OConfig(maxSize: 8, heavyBudget: -1, recentBudget: -1) }
            == "heavy_budget must be >= 0, got -1: use heavy_budget >= 0")
        #expect(message { try H2OConfig(maxSize: 0, step: 0) }
            == "max_size must be >= 1, got 0: use max_size >= 1")
        #expect(message { try H2OConfig(maxSize: 8, emaAlpha: 2.0, step: 0) }
            == "ema_alpha must be in (0, 1), got 2.0: e.g. ema_alpha=0.95")
        #expect(message { try H2OConfig(maxSize: 8, emaAlpha: 2.0, pinned: [3 ..< 3]) }
            == "ema_alpha must be in (0, 1), got 2.0: e.g. ema_alpha=0.95")
        #expect(message { try H2OConfig(maxSize: 8, pinned: [3 ..< 3], step: 0) }
            == "pinned range (3, 3) must be (start, end) with start < end: "
                + "write it as (first position, last position + 1)")
        let overlapping = [0 ..< 2, 1 ..< 3, 5 ..< 20]
        #expect(message { try H2OConfig(maxSize: 8, sinkSize: 1, recentBudget: 3, pinned: overlapping) }
            == "pinned ranges overlap: [(0, 2), (1, 3), (5, 20)]; merge them into one range")
        #expect(try H2OConfig(maxSize: 8, sinkSize: 1, recentBudget: 3, pinned: [10 ..< 14])
            .heavyBudget == 4)
        // Pairs are checked one by one, in order.
        #expect(message { try pinnedRanges([[-1, 2], [3, 3]]) }
            == "pinned range (-1, 2) starts before position 0: start it at >= 0")
        let notPair = { (pair: String, all: String) in
            "pinned must be a tuple of (start, end) int pairs; \(pair) in pinned=\(all) "
                + "is not one (one range: pinned=((start, end),))"
        }
        #expect(message { try pinnedRanges([[1, 2, 3]]) } == notPair("(1, 2, 3)", "((1, 2, 3),)"))
        #expect(message { try pinnedRanges([[0, 1], [1, 2, 3]]) }
            == notPair("(1, 2, 3)", "((0, 1), (1, 2, 3))"))
        #expect(message { try pinnedRanges([[5]]) } == notPair("(5,)", "((5,),)"))
    }

    @Test("rejects a bad window, a bad pinned pair, an unknown mode, prompt compaction")
    func rejects() throws {
        #expect(throws: H2OConfigError("window_size must be >= 1, got 0")) {
            try SlotLedger(config: H2OConfig(maxSize: 8), windowSize: 0)
        }
        #expect(throws: H2OConfigError(
            "pinned range (5, 2) must be (start, end) with start < end: "
                + "write it as (first position, last position + 1)")) {
            try pinnedRanges([[5, 2]])
        }
        #expect(throws: H2OConfigError.self) { try ScoreMode(name: "sum") }
        // Python's prefill_compact="prompt" is not ported; "chunk" is the Swift behaviour.
        #expect(throws: H2OConfigError.self) {
            try H2OConfig(dictionary: ["max_size": 8, "prefill_compact": "prompt"])
        }
        #expect(try H2OConfig(dictionary: ["max_size": 8, "prefill_compact": "chunk"])
            == H2OConfig(maxSize: 8))
        // Python's default "preview" (and "two_pass") is "chunk" where no preview pass runs.
        #expect(try H2OConfig(dictionary: ["max_size": 8, "prefill_compact": "preview"])
            == H2OConfig(maxSize: 8))
        #expect(try H2OConfig(dictionary: ["max_size": 8, "prefill_compact": "two_pass"])
            == H2OConfig(maxSize: 8))
        // Neither is batched eviction (Python's evict_batch > 1).
        #expect(throws: H2OConfigError.self) {
            try H2OConfig(dictionary: ["max_size": 8, "evict_batch": 4])
        }
        #expect(try H2OConfig(dictionary: ["max_size": 8, "evict_batch": 1]) == H2OConfig(maxSize: 8))
        #expect(try ScoreMode(name: "attention_ema") == .attentionEma)
        // Python's key_norm is not ported: refused with an error that says so.
        #expect(
            throws: H2OConfigError(
                "score='key_norm' runs in the Python package only, not in the Swift port; "
                    + "use one of ('ema', 'accumulated', 'normalized', 'attention_ema', 'tova')")
        ) { try H2OConfig(dictionary: ["max_size": 8, "score": "key_norm"]) }
        // Neither is expected_attention (it scores prompt chunks from their queries).
        #expect(
            throws: H2OConfigError(
                "score='expected_attention' runs in the Python package only, not in the "
                    + "Swift port; use one of ('ema', 'accumulated', 'normalized', "
                    + "'attention_ema', 'tova')")
        ) { try H2OConfig(dictionary: ["max_size": 8, "score": "expected_attention"]) }
    }
}
