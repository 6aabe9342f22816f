// H2OKVCache: an mlx-swift-lm KVCache that keeps sinks, heavy hitters and a
// recent window (mirrors mlx_h2o/cache/h2o.py). Counters and decisions come
// from H2OCore's SlotLedger; per-slot data lives on the device.

import Foundation
import H2OCore
import MLX
import MLXLMCommon

/// mlx-swift-lm KV cache with H2O eviction.
///
/// Storage is slot based: preallocated (B, n_kv_heads, slots, D) buffers with a
/// token position per slot. A decode step that evicts writes the new token into
/// the victim's slot (per sequence and KV head), so slot order is not token
/// order and masks come from positions. Chunks of L > 1 tokens are appended,
/// attended in full, then compacted once to `maxSize` tokens. `offset` counts
/// every token seen (it drives RoPE), never the slots used.
///
/// The cache needs the attention's scores: call ``updateAndAttend(queries:keys:values:scale:mask:sinks:)``
/// (what the patched `attentionWithCacheUpdate` does), or ``h2oAttention(queries:keys:values:cache:scale:mask:sinks:)``.
open class H2OKVCache: KVCache {
    public internal(set) var ledger: SlotLedger
    public let storage: H2OSlotStorage
    /// (B, n_kv_heads, capacity): token position, score, visible-query count per slot.
    var positions: MLXArray?
    var score: MLXArray?
    var count: MLXArray?
    public var modelName = ""

    /// `windowSize`: the layer's sliding window (e.g. Gemma 3 local layers), if any.
    public init(config: H2OConfig, windowSize: Int? = nil, storage: H2OSlotStorage = DenseSlots())
        throws
    {
        ledger = try SlotLedger(config: config, windowSize: windowSize)
        self.storage = storage
    }

    public var config: H2OConfig { ledger.config }
    public var windowSize: Int? { ledger.windowSize }
    public var offset: Int { ledger.offset }
    /// Slots in use (tokens kept per sequence and KV head).
    public var size: Int { ledger.size }
    /// Nil: the H2O budget is not a rotating window, which `maxSize` means to mlx-swift-lm.
    public var maxSize: Int? { nil }

    /// An independent cache of the same class with the same slots (arrays are not shared).
    open func copy() -> any KVCache {
        let new = try! H2OKVCache(
            config: config, windowSize: windowSize, storage: storage.makeEmpty())
        return copyInto(new)
    }

    func copyInto(_ new: H2OKVCache) -> H2OKVCache {
        new.metaState = metaState
        new.state = state.map { $0[.ellipsis] }
        return new
    }

    public func innerState() -> [MLXArray] {
        storage.arrays + [positions, score, count].compactMap { $0 }
    }

    public var nbytes: Int {
        storage.nbytes + [positions, score, count].compactMap { $0 }.reduce(0) { $0 + $1.nbytes }
    }

    // MARK: update and attention

    /// Stores the new tokens; returns the dense keys and values of every slot.
    /// The attention over them must report its scores through ``attention(queries:scale:mask:sinks:)``.
    public func update(keys: MLXArray, values: MLXArray) -> (MLXArray, MLXArray) {
        place(keys: keys, values: values)
        return storage.fetch(ledger.size)
    }

    /// `update` then `attention`: the one call the routed attention makes.
    public func updateAndAttend(
        queries: MLXArray, keys: MLXArray, values: MLXArray, scale: Float,
        mask: MLXFast.ScaledDotProductAttentionMaskMode, sinks: MLXArray? = nil
    ) -> MLXArray {
        place(keys: keys, values: values)
        return attention(queries: queries, scale: scale, mask: mask, sinks: sinks)
    }

    /// Attention over the slots after an update, folding in this step's scores
    /// and compacting an overflowing chunk.
    public func attention(
        queries: MLXArray, scale: Float, mask: MLXFast.ScaledDotProductAttentionMaskMode,
        sinks: MLXArray? = nil
    ) -> MLXArray {
        precondition(ledger.awaitingScores, "H2OKVCache.attention needs a preceding update")
        let (n, L) = (ledger.size, queries.dim(2))
        let (out, logits, lse) = storage.attention(
            queries: queries, n: n, scale: scale, mask: combinedMask(L, mask),
            sinks: sinks)
        // Only a chunk that overflows the budget is scored by its window (SnapKV).
        let over = n > config.maxSize
        var (held, seen) = (score![.ellipsis, ..<n], count![.ellipsis, ..<n])
        if over && H2OPolicy.windowReplaces(config: config, chunk: L, before: n - L) {
            // A later chunk on a full cache: its window alone decides.
            (held, seen) = (MLXArray.zeros(like: held), MLXArray.zeros(like: seen))
        }
        let (s, c) = H2OPolicy.foldScores(
            mode: config.score, score: held, count: seen,
            logits: logits, lse: lse, alpha: config.emaAlpha,
            window: over ? config.prefillWindow : 0, positions: positions![.ellipsis, ..<n],
            pool: over ? config.prefillPool : 0)
        score![.ellipsis, ..<n] = s
        count![.ellipsis, ..<n] = c
        let keep =
            n > config.maxSize
            ? H2OPolicy.selectKeep(
                priorities: priorities(offset: ledger.offset, n: n),
                positions: positions![.ellipsis, ..<n], k: config.maxSize) : nil
        if let k = ledger.scoresFolded(), let keep {
            precondition(k == keep.dim(-1))
            gather(keep, n: n)
        }
        guard L == 1 else { return out }
        // Nothing reads the metadata until an eviction decision does: left lazy,
        // each decode step's fold held its logits and memory grew with every
        // token below the budget (docs/DESIGN.md, "Decode paths"). Evaluated with the
        // output, as Python's _with_metadata (one graph, no extra eval).
        return depends(input: out, dependencies: [positions!, score!, count!])
    }

    func place(keys: MLXArray, values: MLXArray) {
        let L = keys.dim(2)
        let plan: SlotLedger.Update
        do {
            plan = try ledger.update(length: L, modelName: modelName)
        } catch {
            fatalError("\(error)")
        }
        let start = ledger.offset - L  // position of the first new token
        switch plan {
        case .append(let slots, let growTo):
            if let growTo { grow(keeping: slots.lowerBound, to: growTo, keys, values) }
            storage.write(at: slots.lowerBound, keys: keys, values: values)
            let (B, Hk) = (keys.dim(0), keys.dim(1))
            let new = MLXArray(Int32(start) ..< Int32(start + L))
            positions![.ellipsis, slots] = broadcast(new, to: [B, Hk, L])
            score![.ellipsis, slots] = MLXArray.zeros([B, Hk, L], dtype: .float32)
            count![.ellipsis, slots] = MLXArray.zeros([B, Hk, L], dtype: .float32)
        case .replaceVictim(let priorityOffset):
            let n = ledger.size
            let victim = H2OPolicy.selectVictim(
                priorities: priorities(offset: priorityOffset, n: n),
                positions: positions![.ellipsis, ..<n])
            let slot = expandedDimensions(victim, axis: -1)  // (B, Hk, 1)
            storage.write(slot: slot, keys: keys, values: values)
            let zero = MLXArray.zeros(slot.shape, dtype: .float32)
            positions = putSlot(positions!, slot, broadcast(MLXArray(Int32(start)), to: slot.shape))
            score = putSlot(score!, slot, zero)
            count = putSlot(count!, slot, zero)
        }
    }

    func grow(keeping n: Int, to size: Int, _ keys: MLXArray, _ values: MLXArray) {
        storage.resize(keeping: n, to: size, keys: keys, values: values)
        let shape = [keys.dim(0), keys.dim(1), size]
        positions = resizeSlots(positions, keeping: n, shape: shape, dtype: .int32)
        score = resizeSlots(score, keeping: n, shape: shape, dtype: .float32)
        count = resizeSlots(count, keeping: n, shape: shape, dtype: .float32)
    }

    /// (B, n_kv_heads, n) eviction priorities for `offset` tokens seen.
    func priorities(offset: Int, n: Int) -> MLXArray {
        let pos = positions![.ellipsis, ..<n]
        let keep = H2OPolicy.isProtected(positions: pos, offset: offset, config: config)
        let s = H2OPolicy.evictionScore(
            mode: config.score, score: score![.ellipsis, ..<n], count: count![.ellipsis, ..<n])
        return H2OPolicy.priority(
            score: s, protected: keep, positions: pos, offset: offset, windowSize: windowSize)
    }

    /// Keeps only `slots` (B, Hk, k) of the first `n`, in that order.
    func gather(_ slots: MLXArray, n: Int) {
        storage.gather(slots, n: n)
        positions = takeSlots(positions!, slots, n: n)
        score = takeSlots(score!, slots, n: n)
        count = takeSlots(count!, slots, n: n)
    }

    // MARK: masks

    /// The model's mask combined with the cache's own (windows from positions).
    func combinedMask(_ L: Int, _ mode: MLXFast.ScaledDotProductAttentionMaskMode) -> ScoresMask {
        let own: ScoresMask
        switch ledger.maskKind(queries: L) {
        case .none: own = .none
        case .causal: own = .causal
        case .window:
            let q = MLXArray(Int32(offset - L) ..< Int32(offset)).reshaped(L, 1)
            let k = expandedDimensions(positions![.ellipsis, ..<size], axis: 2)  // (B, Hk, 1, n)
            own = .array((k .<= q) & (k .> q - windowSize!))  // (B, Hk, L, n)
        }
        // A model mask in another layout (e.g. built from `offset`) cannot
        // describe the slots: only a slot-layout mask (last dim n) is used.
        guard let model = mode.mask, model.dim(-1) == size else { return own }
        guard case .array(let mine) = own else { return .array(model) }
        return .array(
            model.dtype == .bool ? mine & model : which(mine, model, MLXArray(-Float.infinity)))
    }

    public func makeMask(n: Int, windowSize: Int?, returnArray: Bool)
        -> MLXFast.ScaledDotProductAttentionMaskMode
    {
        // Windows are applied from positions in `attention`; this describes the
        // slot layout after the upcoming append (new tokens at the end).
        if n == 1 { return .none }
        if returnArray { return .array(createCausalMask(n: n, offset: size)) }
        return .causal
    }
}
