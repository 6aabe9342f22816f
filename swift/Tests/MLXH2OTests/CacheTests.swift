// H2OKVCache and QuantizedH2OKVCache with their own attention on random
// queries, keys and values: each step's output is the float64 attention over
// exactly the tokens the cache keeps (by position), state / metaState round
// trips give a cache that decodes identically, copies are independent, and
// trim forgets the newest tokens before and after eviction.

import Foundation
import H2OCore
import MLX
import MLXLMCommon
import Testing

@testable import MLXH2O

/// Shapes of the random streams, and a step's seeded q, k, v.
enum Stream {
    static let (B, Hq, Hk, D) = (2, 4, 2, 32)

    static func inputs(_ L: Int, seed: UInt64) -> (MLXArray, MLXArray, MLXArray) {
        (
            normal([B, Hq, L, D], seed: 3 * seed),
            normal([B, Hk, L, D], seed: 3 * seed + 1),
            normal([B, Hk, L, D], seed: 3 * seed + 2)
        )
    }
}

@Suite("H2O caches on MLX arrays (CPU)", .serialized)
struct CacheTests {
    static let config = try! H2OConfig(maxSize: 8, sinkSize: 1, heavyBudget: 3, recentBudget: 4)
    static let scale = 1 / Float(Stream.D).squareRoot()

    static func makeCache(quantized: Bool) throws -> H2OKVCache {
        quantized
            ? try QuantizedH2OKVCache(config: config, bits: 8, groupSize: 32)
            : try H2OKVCache(config: config)
    }

    /// Runs `steps` (chunk lengths) through `cache`; checks each output against
    /// float64 attention over the slots' tokens; returns every token's (k, v).
    @discardableResult
    func run(_ cache: H2OKVCache, steps: [Int], seedBase: UInt64 = 0, start: Int = 0,
             tokens: inout [Int: (k: MLXArray, v: MLXArray)]) throws -> [MLXArray] {
        var outs: [MLXArray] = []
        var position = start
        for (i, L) in steps.enumerated() {
            let (q, k, v) = Stream.inputs(L, seed: seedBase + UInt64(i))
            for l in 0 ..< L { tokens[position + l] = (k[0..., 0..., l], v[0..., 0..., l]) }
            let before = cache.size
            let rows = Stream.B * Stream.Hk
            let held = before > 0 ? cache.positions![.ellipsis, ..<before].asArray(Int32.self) : []
            let out = cache.updateAndAttend(
                queries: q, keys: k, values: v, scale: Self.scale, mask: L > 1 ? .causal : .none)
            eval(out)
            outs.append(out)
            // Attended: a chunk, the slots held before it and the chunk (compaction
            // comes after); a decode step, the slots after its update.
            let n = L > 1 ? before + L : cache.size
            let attended =
                L > 1
                ? (0 ..< rows).flatMap { r in
                    held[r * before ..< (r + 1) * before] + (position ..< position + L).map { Int32($0) }
                }
                : cache.positions![.ellipsis, ..<n].asArray(Int32.self)
            try checkOutput(out, q: q, attended: attended, n: n, queryStart: position,
                tokens: tokens, quantized: cache.storage is QuantizedSlots, at: "step \(i)")
            position += L
        }
        return outs
    }

    func checkOutput(
        _ out: MLXArray, q: MLXArray, attended: [Int32], n: Int, queryStart: Int,
        tokens: [Int: (k: MLXArray, v: MLXArray)], quantized: Bool, at: String
    ) throws {
        let (B, Hk, D, L) = (Stream.B, Stream.Hk, Stream.D, q.dim(2))
        var k = [Double](), v = [Double]()
        for row in 0 ..< B * Hk {
            for j in 0 ..< n {
                let (b, h, p) = (row / Hk, row % Hk, Int(attended[row * n + j]))
                var (kt, vt) = (tokens[p]!.k[b, h], tokens[p]!.v[b, h])
                if quantized {  // a slot holds the token's quantize-dequantize round trip
                    let s = try QuantizedSlots(bits: 8, groupSize: 32)
                    let trip = { (x: MLXArray) in s.dequantize(s.quantize(x.reshaped(1, D))) }
                    (kt, vt) = (trip(kt), trip(vt))
                }
                k += doubles(kt)
                v += doubles(vt)
            }
        }
        // Slot j of a row holds token attended[row * n + j]; causal by position.
        let ref = AttentionCase(
            B: B, Hq: Stream.Hq, Hk: Hk, L: L, N: n, D: D, Dv: D, q: doubles(q), k: k, v: v,
            sinks: [], scale: Double(Self.scale),
            bias: { b, h, l, j in
                let p = attended[(b * Hk + h / (Stream.Hq / Hk)) * n + j]
                return Int(p) <= queryStart + l ? 0 : nil
            })
        let (r64, r32) = (ref.reference(Double.self), ref.reference(Float.self))
        let err32 = try #require(maxError(r32.out, r64.out))
        let err = try #require(maxError(out.asArray(Float.self), r64.out), "\(at): non-finite output")
        #expect(err <= tolerance(float32: err32, reference: r64.out), "\(at): output error \(err)")
    }

    @Test("outputs equal float64 attention over the kept tokens", arguments: [false, true])
    func attendsKeptTokens(quantized: Bool) throws {
        let cache = try Self.makeCache(quantized: quantized)
        var tokens: [Int: (k: MLXArray, v: MLXArray)] = [:]
        try run(cache, steps: [12] + Array(repeating: 1, count: 10), tokens: &tokens)
        #expect(cache.offset == 22 && cache.size == 8 && cache.ledger.evicted == 14)
        let pos = cache.positions![.ellipsis, ..<8].asArray(Int32.self)
        for row in 0 ..< Stream.B * Stream.Hk {
            let kept = Set(pos[row * 8 ..< row * 8 + 8])
            #expect(kept.count == 8 && kept.contains(0), "row \(row): sink kept, no duplicates")
            #expect(Set(18 ... 21).isSubset(of: kept), "row \(row): recent window kept")
        }
    }

    @Test("state and metaState round trip to a cache that decodes the same", arguments: [false, true])
    func stateRoundTrip(quantized: Bool) throws {
        let cache = try Self.makeCache(quantized: quantized)
        cache.modelName = "llama"
        var tokens: [Int: (k: MLXArray, v: MLXArray)] = [:]
        try run(cache, steps: [12, 1, 1, 1], tokens: &tokens)
        let (state, meta) = (cache.state, cache.metaState)
        #expect(meta.prefix(4) == ["15", "7", "", "llama"])
        #expect(meta[4] == Self.config.json)
        if quantized {
            #expect(meta.count == 6 && state.count == 9)  // 2 triples + positions, score, count
        } else {
            #expect(meta.count == 5 && state.count == 5)
        }
        let storage: H2OSlotStorage = quantized ? try QuantizedSlots(bits: 8, groupSize: 32) : DenseSlots()
        let restored = try H2OKVCache.fromState(state: state, metaState: meta, storage: storage)
        let copied = cache.copy() as! H2OKVCache
        #expect(restored.metaState == meta && copied.metaState == meta)
        #expect((copied is QuantizedH2OKVCache) == quantized, "a copy keeps its class")
        for other in [restored, copied] {
            for (a, b) in zip(other.state, state) {
                #expect(a.shape == b.shape && arrayEqual(a, b).item(Bool.self))
            }
        }
        // Decode on: all three make the same decisions and outputs.
        var results: [[MLXArray]] = []
        for c in [cache, restored, copied] {
            var t = tokens
            results.append(try run(c, steps: [1, 1, 1, 1, 1], seedBase: 100, start: 15, tokens: &t))
        }
        for r in results.dropFirst() {
            for (a, b) in zip(r, results[0]) { #expect(arrayEqual(a, b).item(Bool.self)) }
        }
        let positions = [cache, restored, copied].map { $0.positions![.ellipsis, ..<8].asArray(Int32.self) }
        #expect(positions[1] == positions[0] && positions[2] == positions[0])
    }

    @Test("a copy is independent of its source")
    func copyIsIndependent() throws {
        let cache = try Self.makeCache(quantized: false)
        var tokens: [Int: (k: MLXArray, v: MLXArray)] = [:]
        try run(cache, steps: [6], tokens: &tokens)
        let copied = cache.copy() as! H2OKVCache
        let before = copied.state.map { $0.asArray(Float.self) }
        try run(cache, steps: [1, 1, 1, 1], seedBase: 50, start: 6, tokens: &tokens)
        #expect(copied.offset == 6 && copied.size == 6)
        #expect(copied.state.map { $0.asArray(Float.self) } == before)
    }

    @Test("trim before eviction truncates; after it, rows keep their best older slots",
        arguments: [false, true])
    func trim(quantized: Bool) throws {
        let cache = try Self.makeCache(quantized: quantized)
        var tokens: [Int: (k: MLXArray, v: MLXArray)] = [:]
        try run(cache, steps: [6], tokens: &tokens)
        #expect(cache.isTrimmable && cache.trim(2) == 2)
        #expect(cache.offset == 4 && cache.size == 4)
        #expect(cache.positions![.ellipsis, ..<4].asArray(Int32.self) == Array(repeating: [0, 1, 2, 3], count: 4).flatMap { $0 })

        try run(cache, steps: [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], seedBase: 10, start: 4, tokens: &tokens)
        #expect(cache.offset == 14 && cache.size == 8)
        let old = cache.positions![.ellipsis, ..<8].asArray(Int32.self)
        #expect(cache.trim(3) == 3)
        #expect(cache.offset == 11)
        let n = cache.size
        let pos = cache.positions![.ellipsis, ..<n].asArray(Int32.self)
        #expect(pos.allSatisfy { $0 < 11 }, "no trimmed token is left")
        for row in 0 ..< Stream.B * Stream.Hk {
            let kept = Set(pos[row * n ..< (row + 1) * n])
            let had = Set(old[row * 8 ..< row * 8 + 8].filter { $0 < 11 })
            #expect(kept.isSubset(of: had) && kept.contains(0), "row \(row)")
        }
        // Decoding goes on from the trimmed state with positions from the new offset.
        try run(cache, steps: [1, 1], seedBase: 40, start: 11, tokens: &tokens)
        #expect(cache.offset == 13)
    }

    @Test("mlx-swift-lm's cache contract: offset, size, maxSize, masks, nbytes")
    func contract() throws {
        let cache = try Self.makeCache(quantized: false)
        #expect(cache.maxSize == nil && cache.offset == 0)
        var tokens: [Int: (k: MLXArray, v: MLXArray)] = [:]
        try run(cache, steps: [5], tokens: &tokens)
        if case .none = cache.makeMask(n: 1, windowSize: nil, returnArray: false) {} else {
            Issue.record("a decode step needs no mask")
        }
        if case .causal = cache.makeMask(n: 3, windowSize: nil, returnArray: false) {} else {
            Issue.record("a chunk is causal")
        }
        // Causal over the slots after the append: 3 new rows after 5 kept slots.
        guard case .array(let m) = cache.makeMask(n: 3, windowSize: nil, returnArray: true) else {
            Issue.record("returnArray gives an array")
            return
        }
        #expect(m.shape == [3, 8])
        #expect(cache.nbytes == cache.innerState().reduce(0) { $0 + $1.nbytes })
    }
}
