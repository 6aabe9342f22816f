// SlotLedger: growth, decode eviction, compaction and trim decisions.

import H2OCore
import Testing

@Suite("SlotLedger")
struct LedgerTests {

    @Test("grows in steps up to maxSize; an overflowing chunk gets exact room")
    func growth() throws {
        var l = try SlotLedger(config: H2OConfig(maxSize: 10, sinkSize: 1, step: 4))
        #expect(try l.update(length: 3) == .append(slots: 0 ..< 3, growTo: 4))
        #expect(l.scoresFolded() == nil)
        #expect(try l.update(length: 6) == .append(slots: 3 ..< 9, growTo: 10))
        _ = l.scoresFolded()
        #expect(try l.update(length: 1) == .append(slots: 9 ..< 10, growTo: nil))
        _ = l.scoresFolded()
        #expect(try l.update(length: 1) == .replaceVictim(priorityOffset: 11))
        _ = l.scoresFolded()
        #expect(try l.update(length: 5) == .append(slots: 10 ..< 15, growTo: 15))
        #expect(l.scoresFolded() == 10)
        #expect((l.offset, l.evicted, l.size, l.capacity) == (16, 6, 10, 10))
    }

    @Test("a second update before the scores is an error")
    func missingScores() throws {
        var l = try SlotLedger(config: H2OConfig(maxSize: 8))
        _ = try l.update(length: 2)
        #expect(throws: H2OScoresMissing.self) { try l.update(length: 1, modelName: "llama") }
        #expect(H2OScoresMissing(modelName: "llama").description.contains("(model: llama)"))
    }

    @Test("trim: the newest n tokens, before and after eviction")
    func trim() throws {
        var l = try SlotLedger(config: H2OConfig(maxSize: 6, sinkSize: 1, recentBudget: 2))
        _ = try l.update(length: 5)
        _ = l.scoresFolded()
        #expect(l.trim(3) == .truncate(count: 3))
        #expect((l.offset, l.size) == (2, 2))
        _ = try l.update(length: 6)
        _ = l.scoresFolded()  // 8 slots -> 6, evicted 2
        #expect(l.trim(5) == .regather(count: 5, cut: 3))
        l.regathered(size: 2)
        #expect((l.offset, l.size, l.capacity, l.evicted) == (3, 2, 2, 1))
        #expect(l.trim(0) == .truncate(count: 0))
        #expect(l.trim(9) == .regather(count: 3, cut: 0))
    }

    @Test("mask kinds: none, causal, window")
    func masks() throws {
        var l = try SlotLedger(config: H2OConfig(maxSize: 8), windowSize: 3)
        _ = try l.update(length: 2)
        #expect(l.maskKind(queries: 2) == .window)
        _ = l.scoresFolded()
        var plain = try SlotLedger(config: H2OConfig(maxSize: 8))
        _ = try plain.update(length: 1)
        #expect(plain.maskKind(queries: 1) == .none)
        #expect(plain.maskKind(queries: 4) == .causal)
        var early = try SlotLedger(config: H2OConfig(maxSize: 8), windowSize: 3)
        _ = try early.update(length: 1)
        #expect(early.maskKind(queries: 1) == .none)
    }
}
