// mlx-swift-lm's LlamaModel decoding through its own attentionWithCacheUpdate
// (patched with swift/patches) with Swift H2O caches: the greedy tokens, every
// layer's kept positions and its metaState equal the Python package's on mlx-lm's
// Llama (Tests/ModelVectors/tiny_llama.json, swift/scripts/make_model_vectors.py).
// The generator keeps every top-two logit gap above 1e-3, far above float32
// rounding of this model, so equal tokens are expected, not lucky.

import Foundation
import H2OCore
import MLX
import MLXLLM
import MLXLMCommon
import MLXNN
import Testing

@testable import MLXH2O

enum TinyLlama {
    static let folder = URL(fileURLWithPath: #filePath)
        .deletingLastPathComponent().deletingLastPathComponent()
        .appendingPathComponent("ModelVectors")

    static func document() throws -> [String: Any] {
        let data = try Data(contentsOf: folder.appendingPathComponent("tiny_llama.json"))
        let doc = try JSONSerialization.jsonObject(with: data) as! [String: Any]
        guard doc["format"] as? String == "mlx-h2o-swift-model/1" else {
            throw H2OQuantizationError("tiny_llama.json has another format")
        }
        return doc
    }

    /// make_model_vectors.py's `weight`: parameter `index` (sorted names) of `shape`.
    static func weight(_ index: Int, _ shape: [Int], gain: Int) -> MLXArray {
        let n = shape.reduce(1, *)
        let values = (0 ..< n).map { i -> Float in
            var x = UInt64(i + 1) &* 0x9E37_79B9_7F4A_7C15 &+ UInt64(index) &* 0xBF58_476D_1CE4_E5B9
            x ^= x >> 31
            let h = Double((x >> 40) % 1024) / 512 - 1
            if shape.count == 1 { return Float(1 + h / 8) }
            let k = gain - Int((log2(Double(shape.last!).squareRoot())).rounded(.toNearestOrEven))
            return Float(h * pow(2, Double(k)))
        }
        return MLXArray(values).reshaped(shape)
    }

    static func model(_ doc: [String: Any]) throws -> LlamaModel {
        let json = try JSONSerialization.data(withJSONObject: doc["model"]!)
        let model = LlamaModel(try JSONDecoder().decode(LlamaConfiguration.self, from: json))
        let names = model.parameters().flattened().sorted { $0.0 < $1.0 }
        let params = names.enumerated().map { i, p in (p.0, weight(i, p.1.shape, gain: 3)) }
        try model.update(parameters: ModuleParameters.unflattened(params), verify: .all)
        eval(model)
        return model
    }
}

@Suite("tiny Llama through attentionWithCacheUpdate", .serialized)
struct ModelTests {

    @Test("every parameter starts with the generator's values (same names, same formula)")
    func weightsMatch() throws {
        let doc = try TinyLlama.document()
        let probe = doc["weights"] as! [String: [Double]]
        let model = try TinyLlama.model(doc)
        let params = Dictionary(uniqueKeysWithValues: model.parameters().flattened())
        #expect(Set(params.keys) == Set(probe.keys))
        for (name, want) in probe {
            let got = params[name]!.reshaped(-1)[..<want.count].asArray(Float.self)
            #expect(got == want.map { Float($0) }, "\(name)")
        }
    }

    #if MLXH2O_ROUTED
        @Test("greedy tokens, kept positions and metaState equal Python's")
        func decodesLikePython() throws {
            // mlx-swift's SwiftPM build ships MLX's CPU compile preamble as generated on
            // arm64 (`using ::float16_t`), which g++ rejects on x86-64: no kernel fusion.
            compile(enable: false)
            defer { compile(enable: true) }
            let doc = try TinyLlama.document()
            let model = try TinyLlama.model(doc)
            let config = try H2OConfig(dictionary: doc["h2o"] as! [String: Any])
            let cache = try makeH2OCache(
                model.newCache(parameters: nil), config: config, modelName: "llama")
            #expect(cache.allSatisfy { $0 is H2OKVCache })
            let want = doc["tokens"] as! [Int]
            var x = MLXArray((doc["prompt"] as! [Int]).map(Int32.init)).reshaped(1, -1)
            var tokens: [Int] = []
            for _ in want {
                let logits = model(x, cache: cache)[0, -1]
                let token = Int(argMax(logits).item(Int32.self))
                tokens.append(token)
                x = MLXArray([Int32(token)]).reshaped(1, 1)
            }
            #expect(tokens == want)
            let positions = doc["positions"] as! [[[[Int]]]]  // layer, B, Hk, slots
            let meta = doc["meta_state"] as! [[String]]
            for (i, layer) in cache.enumerated() {
                let c = layer as! H2OKVCache
                let got = c.positions![.ellipsis, ..<c.size].asArray(Int32.self).map(Int.init)
                #expect(got == positions[i].flatMap { $0.flatMap { $0 } }, "layer \(i) positions")
                #expect(c.metaState == meta[i], "layer \(i) metaState")
            }
        }

        @Test("attentionWithCacheUpdate routes H2O caches, and only them")
        func routes() throws {
            let (q, k, v) = Stream.inputs(3, seed: 77)
            let config = try H2OConfig(maxSize: 8, sinkSize: 1, heavyBudget: 3)
            let (routed, direct) = (try H2OKVCache(config: config), try H2OKVCache(config: config))
            let a = attentionWithCacheUpdate(
                queries: q, keys: k, values: v, cache: routed, scale: 0.25, mask: .causal)
            let b = direct.updateAndAttend(queries: q, keys: k, values: v, scale: 0.25, mask: .causal)
            #expect(arrayEqual(a, b).item(Bool.self))
            #expect(routed.offset == 3 && !routed.ledger.awaitingScores)
            // A plain cache still takes mlx-swift-lm's path (its SDPA, CPU fallback).
            let simple = KVCacheSimple()
            let c = attentionWithCacheUpdate(
                queries: q, keys: k, values: v, cache: simple, scale: 0.25, mask: .causal)
            let ref = AttentionCase(
                B: Stream.B, Hq: Stream.Hq, Hk: Stream.Hk, L: 3, N: 3, D: Stream.D, Dv: Stream.D,
                q: doubles(q), k: doubles(k), v: doubles(v), sinks: [], scale: 0.25,
                bias: { _, _, l, j in j <= l ? 0 : nil })
            let (r64, r32) = (ref.reference(Double.self), ref.reference(Float.self))
            let err32 = try #require(maxError(r32.out, r64.out))
            let err = try #require(maxError(c.asArray(Float.self), r64.out))
            #expect(err <= tolerance(float32: err32, reference: r64.out))
            #expect(simple.offset == 3)
        }
    #endif
}
