// Float64 references and helpers for the MLXH2O tests: attention computed in
// plain Swift loops (Double, and the same loops in Float to measure what a
// float32 computation of it can be expected to miss), seeded inputs, readback.

import Foundation
import MLX

/// Scalars the reference loops run in.
protocol RefScalar: BinaryFloatingPoint {
    static func exp(_ x: Self) -> Self
    static func log(_ x: Self) -> Self
}
extension Double: RefScalar {
    static func exp(_ x: Double) -> Double { Foundation.exp(x) }
    static func log(_ x: Double) -> Double { Foundation.log(x) }
}
extension Float: RefScalar {
    static func exp(_ x: Float) -> Float { Foundation.exp(x) }
    static func log(_ x: Float) -> Float { Foundation.log(x) }
}

/// Row-major contents of `a` as Double (after a float32 cast).
func doubles(_ a: MLXArray) -> [Double] {
    a.asType(.float32).asArray(Float.self).map(Double.init)
}

/// Normal(0, 1) float32 array of `shape` from `seed`.
func normal(_ shape: [Int], seed: UInt64, dtype: DType = .float32) -> MLXArray {
    MLXRandom.normal(shape, key: MLXRandom.key(seed)).asType(dtype)
}

/// Attention inputs as flat row-major arrays. q (B, Hq, L, D); k (B, Hk, N, D);
/// v (B, Hk, N, Dv); `visible(b, h, l, j)` nil = masked, else an additive bias;
/// sinks (Hq) or empty.
struct AttentionCase {
    var B: Int, Hq: Int, Hk: Int, L: Int, N: Int, D: Int, Dv: Int
    var q: [Double], k: [Double], v: [Double], sinks: [Double]
    var scale: Double
    var bias: (Int, Int, Int, Int) -> Double?

    /// out (B, Hq, L, Dv), logits (B, Hq, L, N) (-inf masked), lse (B, Hq, L) in `T`.
    func reference<T: RefScalar>(_: T.Type) -> (out: [T], logits: [T], lse: [T]) {
        var out = [T](repeating: 0, count: B * Hq * L * Dv)
        var logits = [T](repeating: -.infinity, count: B * Hq * L * N)
        var lse = [T](repeating: -.infinity, count: B * Hq * L)
        let G = Hq / Hk
        for b in 0 ..< B {
            for h in 0 ..< Hq {
                let kv = b * Hk + h / G
                for l in 0 ..< L {
                    let row = (b * Hq + h) * L + l
                    for j in 0 ..< N {
                        guard let add = bias(b, h, l, j) else { continue }
                        var dot: T = 0
                        for d in 0 ..< D {
                            dot += T(q[row * D + d]) * T(k[(kv * N + j) * D + d])
                        }
                        logits[row * N + j] = dot * T(scale) + T(add)
                    }
                    let row0 = row * N
                    var m = logits[row0 ..< row0 + N].max()!
                    if !sinks.isEmpty { m = Swift.max(m, T(sinks[h])) }
                    guard m > -.infinity else { continue }  // fully masked: out 0, lse -inf
                    var denom: T = sinks.isEmpty ? 0 : T.exp(T(sinks[h]) - m)
                    var acc = [T](repeating: 0, count: Dv)
                    for j in 0 ..< N where logits[row0 + j] > -.infinity {
                        let p = T.exp(logits[row0 + j] - m)
                        denom += p
                        for d in 0 ..< Dv { acc[d] += p * T(v[(kv * N + j) * Dv + d]) }
                    }
                    lse[row] = T.log(denom) + m
                    for d in 0 ..< Dv { out[row * Dv + d] = acc[d] / denom }
                }
            }
        }
        return (out, logits, lse)
    }
}

/// Largest |a - b| over entries where both are finite; nil if the -inf patterns differ.
func maxError<T: BinaryFloatingPoint>(_ a: [T], _ b: [Double]) -> Double? {
    guard a.count == b.count else { return nil }
    var worst = 0.0
    for (x, y) in zip(a, b) {
        let x = Double(x)
        if x.isInfinite || y.isInfinite {
            guard x == y else { return nil }
            continue
        }
        worst = Swift.max(worst, Swift.abs(x - y))
    }
    return worst
}

/// The tolerance for a float32 result against the float64 reference: 4x the
/// error of the same loops in float32, and never below 4 float32 ulps of the
/// largest reference value (a float32 result cannot do better than rounding).
func tolerance(float32 err: Double, reference: [Double]) -> Double {
    let big = reference.filter(\.isFinite).map(Swift.abs).max() ?? 0
    return 4 * Swift.max(err, Double(Float.ulpOfOne) * Swift.max(big, 1e-30))
}
