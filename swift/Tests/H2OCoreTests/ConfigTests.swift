// H2OConfig: the Python package's validation rules and messages.

import Foundation
import H2OCore
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
    }

    @Test("rejects a bad window, a bad pinned pair, an unknown mode, prompt compaction")
    func rejects() throws {
        #expect(throws: H2OConfigError("window_size must be >= 1, got 0")) {
            try SlotLedger(config: H2OConfig(maxSize: 8), windowSize: 0)
        }
        #expect(throws: H2OConfigError("pinned range (5, 2) must be (start, end) ints with start < end")) {
            try pinnedRanges([[5, 2]])
        }
        #expect(throws: H2OConfigError.self) { try ScoreMode(name: "sum") }
        // Python's prefill_compact="prompt" is not ported; "chunk" is the Swift behaviour.
        #expect(throws: H2OConfigError.self) {
            try H2OConfig(dictionary: ["max_size": 8, "prefill_compact": "prompt"])
        }
        #expect(try H2OConfig(dictionary: ["max_size": 8, "prefill_compact": "chunk"])
            == H2OConfig(maxSize: 8))
        // Neither is batched eviction (Python's evict_batch > 1).
        #expect(throws: H2OConfigError.self) {
            try H2OConfig(dictionary: ["max_size": 8, "evict_batch": 4])
        }
        #expect(try H2OConfig(dictionary: ["max_size": 8, "evict_batch": 1]) == H2OConfig(maxSize: 8))
        #expect(try ScoreMode(name: "attention_ema") == .attentionEma)
    }
}
