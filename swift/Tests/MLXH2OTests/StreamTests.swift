// The Python cache's streams (swift/Tests/Vectors) replayed through the real
// H2OKVCache / QuantizedH2OKVCache on MLX arrays. The storage's attention
// returns the recorded logits (as the Python generator's does), so the
// decisions under test are the cache's own MLX ops: fold, victim, compaction,
// trim. Each step must give Python's positions, victims, offsets, counts and
// capacities exactly, scores to 1e-5 relative (float32 sums of at most 16
// terms; the generator keeps every decision 1e-4 away from a tie), and the
// mask the cache builds must hide exactly the logits Python masked. Keys and
// values are random; every kept slot must still hold its token's key and value.

import Foundation
import H2OCore
import H2OVectors
import MLX
import Testing

@testable import MLXH2O

/// Storage that attends with scripted logits and forwards everything else.
final class ScriptedSlots: H2OSlotStorage {
    let base: H2OSlotStorage
    var next: (logits: MLXArray, lse: MLXArray)?
    var lastMask: ScoresMask?

    init(_ base: H2OSlotStorage) { self.base = base }

    var capacity: Int { base.capacity }
    var nbytes: Int { base.nbytes }
    var arrays: [MLXArray] { base.arrays }
    var metaState: [String] { base.metaState }
    func resize(keeping n: Int, to size: Int, keys: MLXArray, values: MLXArray) {
        base.resize(keeping: n, to: size, keys: keys, values: values)
    }
    func write(at start: Int, keys: MLXArray, values: MLXArray) {
        base.write(at: start, keys: keys, values: values)
    }
    func write(slot: MLXArray, keys: MLXArray, values: MLXArray) {
        base.write(slot: slot, keys: keys, values: values)
    }
    func gather(_ slots: MLXArray, n: Int) { base.gather(slots, n: n) }
    func fetch(_ n: Int) -> (MLXArray, MLXArray) { base.fetch(n) }
    func state(_ n: Int) -> [MLXArray] { base.state(n) }
    func setState(_ arrays: [MLXArray]) { base.setState(arrays) }
    func setMetaState(_ entries: [String]) throws { try base.setMetaState(entries) }
    func makeEmpty() -> H2OSlotStorage { ScriptedSlots(base.makeEmpty()) }

    func attention(queries: MLXArray, n: Int, scale: Float, mask: ScoresMask, sinks: MLXArray?)
        -> (output: MLXArray, logits: MLXArray, lse: MLXArray)
    {
        guard let (logits, lse) = next else { fatalError("no scripted logits for this call") }
        (next, lastMask) = (nil, mask)
        return (MLXArray.zeros(queries.shape, dtype: queries.dtype), logits, lse)
    }
}

@Suite("Python streams through the MLX caches", .serialized)
struct StreamTests {
    static let D = 32  // one quantization group of the quantized stream

    @Test("stream replays like the Python cache", arguments: Vectors.streamNames)
    func replay(name: String) throws {
        let stream = try Record(Vectors.load(name))
        let config = try H2OConfig(dictionary: stream.d["config"] as! [String: Any])
        let quant = stream.d["quant"] as? [String: Any]
        let base: H2OSlotStorage =
            try quant.map {
                try QuantizedSlots(bits: $0["bits"] as! Int, groupSize: $0["group_size"] as! Int)
            } ?? DenseSlots()
        let storage = ScriptedSlots(base)
        let cache = try H2OKVCache(
            config: config, windowSize: stream.optionalInt("window_size"), storage: storage)
        let (B, Hq, Hk) = (
            try stream.int("batch_size"), try stream.int("n_heads"), try stream.int("n_kv_heads")
        )
        var tokens = Tokens(B: B, Hk: Hk, D: Self.D, quantized: quant != nil, base: base)
        for (i, step) in try stream.records("steps").enumerated() {
            let expect = try step.record("expect")
            let at = "\(name) step \(i)"
            switch try step.string("op") {
            case "update":
                let L = try step.int("length")
                let (k, v) = tokens.next(L, at: cache.offset, seed: UInt64(i))
                cache.place(keys: k, values: v)
                let N = cache.size
                let logits = MLXArray(try step.floats("logits")).reshaped(B, Hq, L, N)
                storage.next = (logits, MLXArray(try step.floats("lse")).reshaped(B, Hq, L))
                let out = cache.attention(
                    queries: MLXArray.zeros([B, Hq, L, Self.D]), scale: 1, mask: .none)
                eval(out)
                try checkMask(storage.lastMask!, logits: logits, Hk: Hk, at: at)
                if let victims = try expect.perRow("victims") {
                    // The victim's slot now holds the new token.
                    let newest = (cache.positions![.ellipsis, ..<N] .== Int32(cache.offset - 1))
                    #expect(argMax(newest, axis: -1).asArray(Int32.self).map(Int.init) == victims,
                        "\(at): victims")
                }
            case "trim":
                #expect(cache.trim(try step.int("n")) == (try expect.int("trimmed")), "\(at): trimmed")
            case let op:
                Issue.record("\(at): unknown op \(op)")
            }
            try checkState(cache, expect, at: at)
            try tokens.checkSlots(cache, at: at)
        }
    }

    /// The cache's mask hides exactly the logits Python masked.
    func checkMask(_ mask: ScoresMask, logits: MLXArray, Hk: Int, at: String) throws {
        let (B, Hq, L, N) = (logits.dim(0), logits.dim(1), logits.dim(2), logits.dim(3))
        let zero = scaledDotProductAttentionWithScores(
            queries: MLXArray.zeros([B, Hq, L, 8]), keys: MLXArray.zeros([B, Hk, N, 8]),
            values: MLXArray.zeros([B, Hk, N, 8]), scale: 1, mask: mask
        ).logits
        let mine = (zero .> -Float.infinity).asArray(Bool.self)
        let python = (logits .> -Float.infinity).asArray(Bool.self)
        let differ = zip(mine, python).filter { $0 != $1 }.count
        #expect(differ == 0, "\(at): mask differs in \(differ) of \(mine.count) entries")
    }

    func checkState(_ cache: H2OKVCache, _ expect: Record, at: String) throws {
        #expect(cache.offset == (try expect.int("offset")), "\(at): offset")
        #expect(cache.ledger.evicted == (try expect.int("evicted")), "\(at): evicted")
        #expect(cache.size == (try expect.int("size")), "\(at): size")
        #expect(cache.ledger.capacity == (try expect.int("capacity")), "\(at): capacity")
        #expect(cache.storage.capacity == (try expect.int("capacity")), "\(at): storage capacity")
        let n = cache.size
        guard let positions = try expect.rows("positions") else {
            #expect(cache.positions == nil || n == 0, "\(at): positions")
            return
        }
        let got = cache.positions![.ellipsis, ..<n].asArray(Int32.self)
        #expect(got == positions.flatMap { $0 }, "\(at): positions")
        let count = cache.count![.ellipsis, ..<n].asArray(Float.self)
        #expect(count == (try expect.floats("count")), "\(at): count")
        let score = cache.score![.ellipsis, ..<n].asArray(Float.self)
        let want = try expect.floats("score")
        #expect(score.count == want.count, "\(at): score count")
        for (g, w) in zip(score, want) where Swift.abs(g - w) > 1e-5 * Swift.max(Swift.abs(w), 1e-2) {
            Issue.record("\(at): score \(g) vs Python \(w)")
            break
        }
    }
}

/// The keys and values fed to a stream, by token position, and the check that
/// each kept slot holds its own token's (dequantized, for a quantized storage).
struct Tokens {
    let B: Int, Hk: Int, D: Int
    let quantized: Bool
    let base: H2OSlotStorage
    var keys: [Int: MLXArray] = [:]  // (B, Hk, D) by position; a trim lets positions be fed again
    var values: [Int: MLXArray] = [:]

    init(B: Int, Hk: Int, D: Int, quantized: Bool, base: H2OSlotStorage) {
        (self.B, self.Hk, self.D, self.quantized, self.base) = (B, Hk, D, quantized, base)
    }

    /// L new tokens from position `start`.
    mutating func next(_ L: Int, at start: Int, seed: UInt64) -> (MLXArray, MLXArray) {
        let k = normal([B, Hk, L, D], seed: 1000 + seed)
        let v = normal([B, Hk, L, D], seed: 2000 + seed)
        for l in 0 ..< L {
            keys[start + l] = stored(k[0..., 0..., l])
            values[start + l] = stored(v[0..., 0..., l])
        }
        return (k, v)
    }

    /// What a slot holds for `x` (B, Hk, D): itself, or its quantize-dequantize round trip.
    func stored(_ x: MLXArray) -> MLXArray {
        guard let q = base as? QuantizedSlots else { return x }
        let t = q.quantize(x)
        return q.dequantize(t)
    }

    func checkSlots(_ cache: H2OKVCache, at: String) throws {
        let n = cache.size
        guard n > 0 else { return }
        let (k, v) = cache.storage.fetch(n)  // (B, Hk, n, D)
        let pos = cache.positions![.ellipsis, ..<n].asArray(Int32.self)
        var wrong = 0
        for b in 0 ..< B {
            for h in 0 ..< Hk {
                for j in 0 ..< n {
                    let p = Int(pos[(b * Hk + h) * n + j])
                    let same =
                        arrayEqual(k[b, h, j], keys[p]![b, h]).item(Bool.self)
                        && arrayEqual(v[b, h, j], values[p]![b, h]).item(Bool.self)
                    if !same { wrong += 1 }
                }
            }
        }
        #expect(wrong == 0, "\(at): \(wrong) slots do not hold their token's key and value")
    }
}
