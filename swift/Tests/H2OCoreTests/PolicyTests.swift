// H2OPolicy and SlotLedger on hand-checked cases (the vectors cover streams).

import Foundation
import H2OCore
import Testing

@Suite("H2OPolicy")
struct PolicyTests {

    @Test("order keys sort by (priority, position) over every float class")
    func orderKeys() {
        let ladder: [Float] = [
            -.infinity, -Float.greatestFiniteMagnitude, -1.5, -Float.leastNonzeroMagnitude,
            0, Float.leastNonzeroMagnitude, 1.5, Float.greatestFiniteMagnitude, .infinity,
        ]
        let keys = ladder.map { H2OPolicy.orderKey(priority: $0, position: 7) }
        #expect(keys == keys.sorted())
        #expect(Set(keys).count == keys.count)
        // -0 and +0 are one priority; position breaks the tie (older first).
        #expect(H2OPolicy.orderKey(priority: -0.0, position: 3) < H2OPolicy.orderKey(priority: 0.0, position: 4))
        #expect(H2OPolicy.orderKey(priority: 0.0, position: 3) < H2OPolicy.orderKey(priority: -0.0, position: 4))
        #expect(H2OPolicy.orderKey(priority: 2, position: 1_000_000) < H2OPolicy.orderKey(priority: 2.0000002, position: 0))
    }

    @Test("the xor-free order map of the MLX twin equals bits ^ 0x7FFFFFFF")
    func xorFree() {
        for bits: Int32 in [-1, -2, Int32.min, Int32.min + 1, -8_388_608, -1_082_130_432] {
            #expect(Int64(bits ^ 0x7FFF_FFFF) == -Int64(bits) - 2_147_483_649)
        }
    }

    @Test("victim: lowest score, ties evict the older position, protected never")
    func victim() {
        let pri: [Float] = [.infinity, 0.5, 0.25, 0.25, .infinity]
        let pos: [Int32] = [0, 9, 6, 4, 12]
        #expect(H2OPolicy.selectVictim(priorities: pri, positions: pos) == 3)
        // Outside a sliding window beats any score.
        #expect(H2OPolicy.selectVictim(priorities: [0.1, -.infinity, .infinity], positions: [1, 5, 6]) == 1)
    }

    @Test("keep: top k by key, returned in position order")
    func keep() {
        let pri: [Float] = [1, .infinity, 3, 3, 0, .infinity]
        let pos: [Int32] = [5, 9, 2, 1, 0, 3]
        #expect(H2OPolicy.selectKeep(priorities: pri, positions: pos, k: 4) == [3, 2, 5, 1])
        // Equal scores at the boundary: the older position (slot 3, position 1) goes.
        #expect(H2OPolicy.selectKeep(priorities: pri, positions: pos, k: 3) == [2, 5, 1])
    }

    @Test("zones: sinks, recent window, pinned; window layers see -inf")
    func zones() throws {
        let c = try H2OConfig(maxSize: 10, sinkSize: 2, recentBudget: 3, pinned: [5 ..< 7])
        let prot = (0 ..< 12).map { H2OPolicy.isProtected(position: Int32($0), offset: 12, config: c) }
        #expect(prot == [true, true, false, false, false, true, true, false, false, true, true, true])
        let p = H2OPolicy.priority(score: 1, protected: true, position: 2, offset: 12, windowSize: 8)
        #expect(p == -.infinity)  // position 2 <= 12 - 1 - 8: out of the window, even if protected
        #expect(H2OPolicy.priority(score: 1, protected: false, position: 3, offset: 12, windowSize: 8) == -.infinity)
        #expect(H2OPolicy.priority(score: 1, protected: false, position: 4, offset: 12, windowSize: 8) == 1)
    }

    @Test("fold: EMA of |logit|, softmax sums, GQA mean, visibility count")
    func fold() throws {
        // B=1, 2 query heads over 1 KV head, L=2 queries, N=2 keys; key 1 hidden from query 0.
        let inf = -Float.infinity
        let s = try AttentionScores(
            batchSize: 1, heads: 2, queries: 2, keys: 2,
            logits: [1, inf, -2, 4, 3, inf, 0, 2], lse: [1, 4, 3, 2])
        var score: [Float] = [0, 0]
        var count: [Float] = [0, 0]
        H2OPolicy.foldScores(
            mode: .ema, score: &score, count: &count, scores: s, batch: 0, kvHead: 0,
            kvHeads: 1, alpha: 0.5)
        // key 0: (mean(|1|,|3|) + mean(|-2|,|0|)) / 2 queries; key 1: mean(4,2) / 1 query
        #expect(score == [1.5, 3])
        #expect(count == [2, 1])
        H2OPolicy.foldScores(
            mode: .ema, score: &score, count: &count, scores: s, batch: 0, kvHead: 0,
            kvHeads: 1, alpha: 0.5)
        #expect(score == [1.5, 3])  // alpha * s + (1 - alpha) * step with step == s
        #expect(count == [4, 2])
        var acc: [Float] = [1, 0]
        var seen: [Float] = [0, 0]
        H2OPolicy.foldScores(
            mode: .accumulated, score: &acc, count: &seen, scores: s, batch: 0, kvHead: 0,
            kvHeads: 1, alpha: 0.95)
        // key 0: q0 mean(e^0, e^0) + q1 mean(e^-6, e^-2); key 1: q1 mean(e^0, e^0)
        let want0 = Float(1 + 1 + (Foundation.exp(-6.0) + Foundation.exp(-2.0)) / 2)
        #expect(Swift.abs(acc[0] - want0) < 1e-6)
        #expect(acc[1] == 1)
        #expect(seen == [2, 1])
    }

    @Test("a later overflowing chunk on a full cache replaces the scores; the first adds")
    func windowReplaces() throws {
        let c = try H2OConfig(maxSize: 8, prefillWindow: 3)
        let replaces = { (chunk: Int, before: Int) in
            H2OPolicy.windowReplaces(config: c, chunk: chunk, before: before)
        }
        #expect(replaces(3, 8) && replaces(5, 8) && replaces(3, 9))  // L >= W on a full cache
        #expect(!replaces(2, 8))  // shorter than its window: every query adds
        #expect(!replaces(5, 7) && !replaces(12, 0))  // the first chunk to overflow adds
        let noWindow = try H2OConfig(maxSize: 8, prefillWindow: 0)
        #expect(!H2OPolicy.windowReplaces(config: noWindow, chunk: 5, before: 8))
    }
}
