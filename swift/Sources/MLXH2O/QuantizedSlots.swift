// Quantized K/V slot storage: MLX affine triples at one width (mirrors
// QuantizedKV in mlx_h2o/cache/quantized_storage.py). Quantization is per token
// (groups run along head_dim), so every slot operation moves whole triples.

import Foundation
import MLX

/// Packed weights, scales and biases of (B, n_kv_heads, slots, ·).
public typealias QuantizedTriple = (weights: MLXArray, scales: MLXArray, biases: MLXArray)

/// The layouts the Python package supports (`check_quantization`).
public func checkQuantization(bits: Int, groupSize: Int, headDim: Int? = nil) throws {
    if ![2, 4, 8].contains(bits) {
        throw H2OQuantizationError("bits=\(bits) is not supported; use one of (2, 4, 8)")
    }
    if ![32, 64, 128].contains(groupSize) {
        throw H2OQuantizationError(
            "group_size=\(groupSize) is not supported; use one of (32, 64, 128)")
    }
    if let headDim, headDim % groupSize != 0 {
        throw H2OQuantizationError(
            "head_dim=\(headDim) is not a multiple of group_size=\(groupSize): "
                + "use a group size that divides the head dimension")
    }
}

public struct H2OQuantizationError: Error, CustomStringConvertible {
    public let description: String
    public init(_ description: String) { self.description = description }
}

/// Keys and values as affine-quantized triples.
public final class QuantizedSlots: H2OSlotStorage {
    public let bits: Int
    public let groupSize: Int
    var keys: QuantizedTriple?
    var values: QuantizedTriple?

    public init(bits: Int = 8, groupSize: Int = 64) throws {
        try checkQuantization(bits: bits, groupSize: groupSize)
        (self.bits, self.groupSize) = (bits, groupSize)
    }

    public var capacity: Int { keys?.weights.dim(2) ?? 0 }
    public var arrays: [MLXArray] { [keys, values].compactMap { $0 }.flatMap(list) }
    public var nbytes: Int { arrays.reduce(0) { $0 + $1.nbytes } }

    func list(_ t: QuantizedTriple) -> [MLXArray] { [t.weights, t.scales, t.biases] }

    func map(_ t: QuantizedTriple, _ f: (MLXArray) -> MLXArray) -> QuantizedTriple {
        (f(t.weights), f(t.scales), f(t.biases))
    }

    func quantize(_ x: MLXArray) -> QuantizedTriple {
        let q = quantized(x, groupSize: groupSize, bits: bits)
        // Affine quantization always has biases.
        return (q.wq, q.scales, q.biases!)
    }

    public func resize(keeping n: Int, to size: Int, keys k: MLXArray, values v: MLXArray) {
        for d in [k.dim(3), v.dim(3)] {
            do { try checkQuantization(bits: bits, groupSize: groupSize, headDim: d) } catch {
                fatalError("\(error)")
            }
        }
        keys = resized(keys, n, size, k)
        values = resized(values, n, size, v)
    }

    private func resized(_ old: QuantizedTriple?, _ n: Int, _ size: Int, _ x: MLXArray)
        -> QuantizedTriple
    {
        let (B, Hk, D) = (x.dim(0), x.dim(1), x.dim(3))
        return (
            resizeSlots(old?.weights, keeping: n, shape: [B, Hk, size, D * bits / 32], dtype: .uint32),
            resizeSlots(old?.scales, keeping: n, shape: [B, Hk, size, D / groupSize], dtype: x.dtype),
            resizeSlots(old?.biases, keeping: n, shape: [B, Hk, size, D / groupSize], dtype: x.dtype)
        )
    }

    public func write(at start: Int, keys k: MLXArray, values v: MLXArray) {
        let end = start + k.dim(2)
        for (stored, new) in [(keys!, quantize(k)), (values!, quantize(v))] {
            for (a, x) in zip(list(stored), list(new)) {
                a[.ellipsis, start ..< end, 0...] = x
            }
        }
    }

    public func write(slot: MLXArray, keys k: MLXArray, values v: MLXArray) {
        let (qk, qv) = (quantize(k), quantize(v))
        keys = (
            putSlot(keys!.weights, slot, qk.weights), putSlot(keys!.scales, slot, qk.scales),
            putSlot(keys!.biases, slot, qk.biases)
        )
        values = (
            putSlot(values!.weights, slot, qv.weights), putSlot(values!.scales, slot, qv.scales),
            putSlot(values!.biases, slot, qv.biases)
        )
    }

    public func gather(_ slots: MLXArray, n: Int) {
        keys = map(keys!) { takeSlots($0, slots, n: n) }
        values = map(values!) { takeSlots($0, slots, n: n) }
    }

    func triples(_ n: Int) -> (QuantizedTriple, QuantizedTriple) {
        (map(keys!) { $0[.ellipsis, ..<n, 0...] }, map(values!) { $0[.ellipsis, ..<n, 0...] })
    }

    /// Values computed as scale * q + bias in float32 (the reference's choice).
    func dequantize(_ t: QuantizedTriple) -> MLXArray {
        dequantized(
            t.weights, scales: t.scales.asType(.float32), biases: t.biases.asType(.float32),
            groupSize: groupSize, bits: bits)
    }

    public func fetch(_ n: Int) -> (MLXArray, MLXArray) {
        let (k, v) = triples(n)
        return (dequantize(k), dequantize(v))
    }

    public func attention(
        queries: MLXArray, n: Int, scale: Float, mask: ScoresMask, sinks: MLXArray?
    ) -> (output: MLXArray, logits: MLXArray, lse: MLXArray) {
        let (qk, qv) = triples(n)
        if let fused = metalQuantizedAttention(
            queries: queries, keys: qk, values: qv, scale: scale, bits: bits,
            groupSize: groupSize, mask: mask, sinks: sinks)
        {
            return fused
        }
        // Specification path: dequantize in float32, then the dense reference.
        let (k, v) = (dequantize(qk), dequantize(qv))
        let (out, logits, lse) = scaledDotProductAttentionWithScores(
            queries: queries, keys: k, values: v, scale: scale, mask: mask, sinks: sinks)
        return (out.asType(queries.dtype), logits, lse)
    }

    public func state(_ n: Int) -> [MLXArray] {
        let (k, v) = triples(n)
        return list(k) + list(v)
    }

    public func setState(_ arrays: [MLXArray]) {
        guard !arrays.isEmpty else { (keys, values) = (nil, nil); return }
        precondition(arrays.count == 6, "quantized H2O storage state is two (w, scales, biases)")
        keys = (arrays[0], arrays[1], arrays[2])
        values = (arrays[3], arrays[4], arrays[5])
    }

    /// The Python package's `json.dumps(asdict(QuantConfig))` (uniform width).
    public var metaState: [String] {
        ["{\"bits\": \(bits), \"group_size\": \(groupSize), \"recent_bits\": null}"]
    }

    public func setMetaState(_ entries: [String]) throws {
        guard entries.count == 1,
            let d = try JSONSerialization.jsonObject(with: Data(entries[0].utf8)) as? [String: Any],
            d["bits"] as? Int == bits, d["group_size"] as? Int == groupSize,
            d["recent_bits"] == nil || d["recent_bits"] is NSNull
        else {
            throw H2OQuantizationError(
                "metaState \(entries) does not describe \(bits)-bit groups of \(groupSize)")
        }
    }

    public func makeEmpty() -> H2OSlotStorage { try! QuantizedSlots(bits: bits, groupSize: groupSize) }
}
