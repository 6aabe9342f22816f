// The attention entry point for H2O caches, and the routing hook.
//
// mlx-swift-lm's attentionWithCacheUpdate never hands the queries to the cache,
// so an H2O cache cannot see its scores there. Two ways in:
//  - patched mlx-swift-lm (swift/patches): H2OKVCache conforms to
//    KVCacheAttentionProtocol and every model that calls
//    attentionWithCacheUpdate is routed, unchanged;
//  - an app that owns its attention code calls h2oAttention instead.

import H2OCore
import MLX
import MLXLMCommon

/// Attention with a cache update, H2O-aware: H2O caches attend over their slots
/// and fold in the scores; any other cache (or none) takes mlx-swift-lm's path.
///
/// - Parameters:
///   - queries: (B, n_heads, L, D); keys, values: (B, n_kv_heads, L, D) new tokens.
///   - mask: the model's mask; an H2O cache applies its own causal and window
///     masks from token positions.
///   - sinks: optional (n_heads) attention-sink logits.
/// - Returns: (B, n_heads, L, D).
public func h2oAttention(
    queries: MLXArray, keys: MLXArray, values: MLXArray, cache: KVCache?, scale: Float,
    mask: MLXFast.ScaledDotProductAttentionMaskMode = .none, sinks: MLXArray? = nil
) -> MLXArray {
    if let cache = cache as? H2OKVCache {
        return cache.updateAndAttend(
            queries: queries, keys: keys, values: values, scale: scale, mask: mask, sinks: sinks)
    }
    guard let sinks else {
        return attentionWithCacheUpdate(
            queries: queries, keys: keys, values: values, cache: cache, scale: scale, mask: mask)
    }
    let (k, v) = cache?.update(keys: keys, values: values) ?? (keys, values)
    return MLXFast.scaledDotProductAttention(
        queries: queries, keys: k, values: v, scale: scale, mask: mask, sinks: sinks)
}

/// One H2O cache per attention layer, replacing what `newCache` made: plain
/// `KVCacheSimple` layers get `H2OKVCache(config)`, sliding-window
/// `RotatingKVCache` layers one that keeps their window; other caches (SSM
/// state, ...) stay as they are.
public func makeH2OCache(
    _ caches: [KVCache], config: H2OConfig, modelName: String = "",
    storage: () throws -> H2OSlotStorage = { DenseSlots() }
) throws -> [KVCache] {
    try caches.map { cache in
        let window: Int?
        switch cache {
        case is KVCacheSimple: window = nil
        case let rotating as RotatingKVCache: window = rotating.maxSize
        default: return cache
        }
        let h2o = try H2OKVCache(config: config, windowSize: window, storage: storage())
        h2o.modelName = modelName
        return h2o
    }
}

#if MLXH2O_ROUTED
    extension H2OKVCache: KVCacheAttentionProtocol {
        public func updateAndAttend(
            queries: MLXArray, keys: MLXArray, values: MLXArray, scale: Float,
            mask: MLXFast.ScaledDotProductAttentionMaskMode
        ) -> MLXArray {
            updateAndAttend(
                queries: queries, keys: keys, values: values, scale: scale, mask: mask,
                sinks: nil)
        }
    }
#endif
