// The reference attention with scores (what every H2O cache attends with where
// no Metal kernel runs) against float64 loops: output, logits and lse, for GQA,
// every mask form, sinks, fully masked rows, and key counts that are not
// multiples of any block size (97, 257).

import Foundation
import MLX
import Testing

@testable import MLXH2O

@Suite("reference attention with scores vs float64", .serialized)
struct AttentionTests {

    struct Shape: CustomStringConvertible, Sendable {
        let B: Int, Hq: Int, Hk: Int, L: Int, N: Int, D: Int
        let mask: String
        var description: String { "B\(B) Hq\(Hq) Hk\(Hk) L\(L) N\(N) D\(D) \(mask)" }
    }

    static let shapes: [Shape] = [
        Shape(B: 1, Hq: 4, Hk: 2, L: 1, N: 97, D: 64, mask: "none"),
        Shape(B: 2, Hq: 4, Hk: 2, L: 5, N: 257, D: 32, mask: "causal"),
        Shape(B: 2, Hq: 4, Hk: 4, L: 3, N: 97, D: 16, mask: "bool"),
        Shape(B: 1, Hq: 6, Hk: 2, L: 2, N: 33, D: 16, mask: "additive-kv-heads"),
        Shape(B: 1, Hq: 4, Hk: 1, L: 4, N: 20, D: 8, mask: "causal+sinks"),
    ]

    @Test("output, logits and lse match float64", arguments: shapes)
    func matchesFloat64(shape s: Shape) throws {
        let seed = UInt64(s.N * 131 + s.L)
        let q = normal([s.B, s.Hq, s.L, s.D], seed: seed)
        let k = normal([s.B, s.Hk, s.N, s.D], seed: seed + 1)
        let v = normal([s.B, s.Hk, s.N, s.D], seed: seed + 2)
        let scale = 1 / Float(s.D).squareRoot()
        var mask = ScoresMask.none
        var bias: (Int, Int, Int, Int) -> Double? = { _, _, _, _ in 0 }
        let causal: (Int, Int, Int, Int) -> Double? = { _, _, l, j in
            j <= s.N - s.L + l ? 0 : nil
        }
        var sinks: MLXArray? = nil
        switch s.mask {
        case "causal", "causal+sinks":
            (mask, bias) = (.causal, causal)
            if s.mask == "causal+sinks" { sinks = normal([s.Hq], seed: seed + 3) }
        case "bool":
            // Random visibility with one fully masked row (b 1, head 2, query 0).
            let r = MLXRandom.uniform(0 ..< 1, [s.B, s.Hq, s.L, s.N], key: MLXRandom.key(seed + 4))
            let m = r .> Float(0.3)
            m[1, 2, 0] = MLXArray.zeros([s.N], dtype: .bool)
            let seen = m.asArray(Bool.self)
            (mask, bias) = (.array(m), { b, h, l, j in seen[((b * s.Hq + h) * s.L + l) * s.N + j] ? 0 : nil })
        case "additive-kv-heads":
            // One additive mask per KV head (shared by its query group), -inf entries included.
            let add = normal([s.B, s.Hk, s.L, s.N], seed: seed + 5)
            let masked = which(add .> Float(1.2), MLXArray(-Float.infinity), add)
            let values = doubles(masked)
            let G = s.Hq / s.Hk
            (mask, bias) = (.array(masked), { b, h, l, j in
                let x = values[((b * s.Hk + h / G) * s.L + l) * s.N + j]
                return x.isInfinite ? nil : x
            })
        default:
            break
        }
        let (out, logits, lse) = scaledDotProductAttentionWithScores(
            queries: q, keys: k, values: v, scale: scale, mask: mask, sinks: sinks)
        #expect(out.shape == [s.B, s.Hq, s.L, s.D])
        #expect(logits.shape == [s.B, s.Hq, s.L, s.N] && logits.dtype == .float32)
        #expect(lse.shape == [s.B, s.Hq, s.L] && lse.dtype == .float32)

        let ref = AttentionCase(
            B: s.B, Hq: s.Hq, Hk: s.Hk, L: s.L, N: s.N, D: s.D, Dv: s.D,
            q: doubles(q), k: doubles(k), v: doubles(v), sinks: sinks.map(doubles) ?? [],
            scale: Double(scale), bias: bias)
        let r64 = ref.reference(Double.self)
        let r32 = ref.reference(Float.self)
        let got: [(String, [Float], [Double], [Float])] = [
            ("out", out.asArray(Float.self), r64.out, r32.out),
            ("logits", logits.asArray(Float.self), r64.logits, r32.logits),
            ("lse", lse.asArray(Float.self), r64.lse, r32.lse),
        ]
        for (name, mlx, want, f32) in got {
            let err32 = try #require(maxError(f32, want), "\(s) \(name): float32 loops")
            let tol = tolerance(float32: err32, reference: want)
            let err = try #require(maxError(mlx, want), "\(s) \(name): -inf pattern differs")
            #expect(err <= tol, "\(s) \(name): error \(err) > \(tol) (float32 loops: \(err32))")
        }
        if s.mask == "bool" {  // the fully masked row: out 0, lse -inf
            #expect(out[1, 2, 0].asArray(Float.self).allSatisfy { $0 == 0 })
            #expect(lse[1, 2, 0].item(Float.self) == -Float.infinity)
        }
    }

    @Test("float16 inputs: float32 scores, output in float16")
    func halfPrecision() {
        let q = normal([1, 2, 1, 16], seed: 7, dtype: .float16)
        let k = normal([1, 2, 9, 16], seed: 8, dtype: .float16)
        let (out, logits, lse) = scaledDotProductAttentionWithScores(
            queries: q, keys: k, values: k, scale: 0.25)
        #expect(out.dtype == .float16)
        #expect(logits.dtype == .float32 && lse.dtype == .float32)
        // The logits are float32 dot products of the float16 values, as in the loops.
        let ref = AttentionCase(
            B: 1, Hq: 2, Hk: 2, L: 1, N: 9, D: 16, Dv: 16, q: doubles(q), k: doubles(k),
            v: doubles(k), sinks: [], scale: 0.25, bias: { _, _, _, _ in 0 })
        let (r64, r32) = (ref.reference(Double.self), ref.reference(Float.self))
        let err32 = maxError(r32.logits, r64.logits) ?? .infinity
        let err = maxError(logits.asArray(Float.self), r64.logits) ?? .infinity
        #expect(err <= tolerance(float32: err32, reference: r64.logits))
    }

    #if os(Linux)
        @Test("the CPU build: default device CPU, the reference attention, never Metal kernels")
        func noMetalOnLinux() {
            #expect(Device.defaultDevice().deviceType == .cpu)
            let q = normal([1, 2, 1, 64], seed: 9)
            let k = normal([1, 2, 40, 64], seed: 10)
            #expect(!metalDecodeSupported(queries: q, keys: k, values: k))
            let a = attentionWithScores(queries: q, keys: k, values: k, scale: 0.125)
            let b = scaledDotProductAttentionWithScores(queries: q, keys: k, values: k, scale: 0.125)
            #expect(allClose(a.output, b.output, rtol: 0, atol: 0).item(Bool.self))
        }
    #endif
}
