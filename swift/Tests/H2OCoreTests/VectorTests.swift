// Replays the Python cache's streams (swift/Tests/Vectors) through H2OSlots.
//
// Positions, victims, offsets and counts must match exactly. Scores are float32
// sums and EMAs whose only differences from MLX are exp() (a few ulp) and
// summation order over <= 16 terms, so a relative 1e-5 (~100 ulp) bounds them;
// the generator guarantees no eviction decision hinges on a gap that small.

import Foundation
import H2OCore
import H2OVectors
import Testing

@Suite("Python parity vectors")
struct VectorTests {

    @Test("vector files are present and small")
    func vectorsPresent() throws {
        #expect(Vectors.streamNames.count >= 6)
        let files = try FileManager.default.contentsOfDirectory(atPath: Vectors.folder.path)
        let bytes = try files.reduce(0) { total, name in
            let attributes = try FileManager.default.attributesOfItem(
                atPath: Vectors.folder.appendingPathComponent(name).path)
            return total + ((attributes[.size] as? NSNumber)?.intValue ?? 0)
        }
        #expect(bytes < 200_000)
    }

    @Test("stream replays like the Python cache", arguments: Vectors.streamNames)
    func replay(name: String) throws {
        let stream = try Record(Vectors.load(name))
        var slots = try H2OSlots(stream: stream)
        let (B, Hq, Hk) = (
            try stream.int("batch_size"), try stream.int("n_heads"), try stream.int("n_kv_heads")
        )
        for (i, step) in try stream.records("steps").enumerated() {
            let expect = try step.record("expect")
            let at = "\(name) step \(i)"
            switch try step.string("op") {
            case "update":
                let L = try step.int("length")
                try slots.update(batchSize: B, kvHeads: Hk, length: L)
                #expect(slots.lastVictims == (try expect.perRow("victims")), "\(at): victims")
                let scores = try AttentionScores(
                    batchSize: B, heads: Hq, queries: L, keys: slots.size,
                    logits: step.floats("logits"), lse: step.floats("lse"))
                try checkMask(scores, slots: slots, at: at)
                try slots.fold(scores)
            case "trim":
                let trimmed = slots.trim(try step.int("n"))
                #expect(trimmed == (try expect.int("trimmed")), "\(at): trimmed")
            case let op:
                Issue.record("\(at): unknown op \(op)")
            }
            try checkState(slots, expect, at: at)
        }
    }

    /// The -inf pattern of the Python logits is the mask H2OSlots derives.
    func checkMask(_ s: AttentionScores, slots: H2OSlots, at: String) throws {
        let window = slots.windowMask(queries: s.queries)
        let kind = slots.ledger.maskKind(queries: s.queries)
        var mismatches = 0
        for b in 0 ..< s.batchSize {
            for h in 0 ..< s.heads {
                let row = b * slots.kvHeads + h / (s.heads / slots.kvHeads)
                for l in 0 ..< s.queries {
                    for j in 0 ..< s.keys {
                        let seen = s.logits[((b * s.heads + h) * s.queries + l) * s.keys + j] > -.infinity
                        let want: Bool
                        switch kind {
                        case .none: want = true
                        case .causal: want = j <= s.keys - s.queries + l
                        case .window: want = window![row][l][j]
                        }
                        if seen != want { mismatches += 1 }
                    }
                }
            }
        }
        #expect(mismatches == 0, "\(at): mask (\(kind)) differs in \(mismatches) entries")
    }

    func checkState(_ slots: H2OSlots, _ expect: Record, at: String) throws {
        #expect(slots.offset == (try expect.int("offset")), "\(at): offset")
        #expect(slots.ledger.evicted == (try expect.int("evicted")), "\(at): evicted")
        #expect(slots.size == (try expect.int("size")), "\(at): size")
        #expect(slots.ledger.capacity == (try expect.int("capacity")), "\(at): capacity")
        let positions = try expect.rows("positions") ?? []
        #expect(slots.positions == positions, "\(at): positions")
        #expect(slots.count.flatMap { $0 } == (try expect.floats("count")), "\(at): count")
        let want = try expect.floats("score")
        let got = slots.score.flatMap { $0 }
        #expect(got.count == want.count, "\(at): score count")
        for (g, w) in zip(got, want) where Swift.abs(g - w) > 1e-5 * Swift.max(Swift.abs(w), 1e-2) {
            Issue.record("\(at): score \(g) vs Python \(w)")
            break
        }
    }
}
