// K/V slot storage: preallocated buffers with the slot on axis 2 (mirrors
// mlx_h2o/cache/storage.py). The cache owns the bookkeeping (positions,
// scores); a storage owns the tensors and knows how to attend over them.

import MLX

/// A zeroed buffer of `shape` holding the first `n` slots of `old`.
func resizeSlots(_ old: MLXArray?, keeping n: Int, shape: [Int], dtype: DType) -> MLXArray {
    let new = MLXArray.zeros(shape, dtype: dtype)
    if let old, n > 0 {
        new[0..., 0..., ..<n] = old[0..., 0..., ..<n]
    }
    return new
}

/// Gathers `slots` (B, Hk, k) along axis 2 of the first `n` slots of `a`.
func takeSlots(_ a: MLXArray, _ slots: MLXArray, n: Int) -> MLXArray {
    let index = a.ndim == 3 ? slots : expandedDimensions(slots, axis: -1)
    return takeAlong(a[0..., 0..., ..<n], index, axis: 2)
}

/// Writes `value` (B, Hk, 1[, D]) into `slot` (B, Hk, 1) along axis 2.
func putSlot(_ a: MLXArray, _ slot: MLXArray, _ value: MLXArray) -> MLXArray {
    let index = a.ndim == 3 ? slot : expandedDimensions(slot, axis: -1)
    return putAlong(a, index, values: value, axis: 2)
}

/// Storage of an H2O cache's keys and values.
public protocol H2OSlotStorage: AnyObject {
    /// Slots allocated.
    var capacity: Int { get }
    var nbytes: Int { get }
    /// Grows to `size` slots, keeping the first `n`; `keys`/`values` give B, heads, dims, dtype.
    func resize(keeping n: Int, to size: Int, keys: MLXArray, values: MLXArray)
    /// Writes (B, Hk, L, D) tokens into slots `start ..< start + L`.
    func write(at start: Int, keys: MLXArray, values: MLXArray)
    /// Writes one token per (sequence, KV head) into `slot` (B, Hk, 1).
    func write(slot: MLXArray, keys: MLXArray, values: MLXArray)
    /// Keeps only `slots` (B, Hk, k) of the first `n`, in that order.
    func gather(_ slots: MLXArray, n: Int)
    /// Dense keys and values of the first `n` slots (dequantized if needed).
    func fetch(_ n: Int) -> (MLXArray, MLXArray)
    /// Attention over the first `n` slots with its logits and lse.
    func attention(
        queries: MLXArray, n: Int, scale: Float, mask: ScoresMask, sinks: MLXArray?
    ) -> (output: MLXArray, logits: MLXArray, lse: MLXArray)
    /// Arrays of the first `n` slots, for serialization.
    func state(_ n: Int) -> [MLXArray]
    /// Restores `state`; empty clears the storage.
    func setState(_ arrays: [MLXArray])
    /// Extra metaState entries after the cache's five (e.g. the quantization).
    var metaState: [String] { get }
    func setMetaState(_ entries: [String]) throws
    /// An empty storage of the same kind and settings.
    func makeEmpty() -> H2OSlotStorage
    /// Every array held, for `eval`.
    var arrays: [MLXArray] { get }
}

/// Keys and values as plain (B, n_kv_heads, slots, D) arrays.
public final class DenseSlots: H2OSlotStorage {
    var keys: MLXArray?
    var values: MLXArray?

    public init() {}

    public var capacity: Int { keys?.dim(2) ?? 0 }
    public var nbytes: Int { (keys?.nbytes ?? 0) + (values?.nbytes ?? 0) }
    public var arrays: [MLXArray] { [keys, values].compactMap { $0 } }

    public func resize(keeping n: Int, to size: Int, keys k: MLXArray, values v: MLXArray) {
        let (B, Hk) = (k.dim(0), k.dim(1))
        keys = resizeSlots(keys, keeping: n, shape: [B, Hk, size, k.dim(3)], dtype: k.dtype)
        values = resizeSlots(values, keeping: n, shape: [B, Hk, size, v.dim(3)], dtype: v.dtype)
    }

    public func write(at start: Int, keys k: MLXArray, values v: MLXArray) {
        let end = start + k.dim(2)
        keys![.ellipsis, start ..< end, 0...] = k
        values![.ellipsis, start ..< end, 0...] = v
    }

    public func write(slot: MLXArray, keys k: MLXArray, values v: MLXArray) {
        keys = putSlot(keys!, slot, k)
        values = putSlot(values!, slot, v)
    }

    public func gather(_ slots: MLXArray, n: Int) {
        keys = takeSlots(keys!, slots, n: n)
        values = takeSlots(values!, slots, n: n)
    }

    public func fetch(_ n: Int) -> (MLXArray, MLXArray) {
        (keys![.ellipsis, ..<n, 0...], values![.ellipsis, ..<n, 0...])
    }

    public func attention(
        queries: MLXArray, n: Int, scale: Float, mask: ScoresMask, sinks: MLXArray?
    ) -> (output: MLXArray, logits: MLXArray, lse: MLXArray) {
        let (k, v) = fetch(n)
        return attentionWithScores(
            queries: queries, keys: k, values: v, scale: scale, mask: mask, sinks: sinks)
    }

    public func state(_ n: Int) -> [MLXArray] {
        let (k, v) = fetch(n)
        return [k, v]
    }

    public func setState(_ arrays: [MLXArray]) {
        precondition(arrays.count % 2 == 0 && arrays.count <= 2, "dense state is (keys, values)")
        (keys, values) = arrays.isEmpty ? (nil, nil) : (arrays[0], arrays[1])
    }

    public var metaState: [String] { [] }

    public func setMetaState(_ entries: [String]) throws {
        guard entries.isEmpty else {
            throw H2OQuantizationError("a dense H2O cache has no storage metaState, got \(entries)")
        }
    }

    public func makeEmpty() -> H2OSlotStorage { DenseSlots() }
}
