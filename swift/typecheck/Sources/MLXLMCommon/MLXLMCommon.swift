// Stubs of the mlx-swift-lm API surface MLXH2O uses (KVCache, RotatingKVCache,
// attentionWithCacheUpdate, and KVCacheAttentionProtocol from patches/0001).
import MLX
public protocol KVCache: Evaluatable {
  var offset: Int { get }
  var maxSize: Int? { get }
  func update(keys: MLXArray, values: MLXArray) -> (MLXArray, MLXArray)
  var state: [MLXArray] { get set }
  var metaState: [String] { get set }
  var isTrimmable: Bool { get }
  @discardableResult func trim(_ n: Int) -> Int
  func makeMask(n: Int, windowSize: Int?, returnArray: Bool) -> MLXFast.ScaledDotProductAttentionMaskMode
  func copy() -> any KVCache
}
public class KVCacheSimple {}
public class RotatingKVCache { public var maxSize: Int? { 1 } }
public func createCausalMask(n: Int, offset: Int, windowSize: Int? = nil, lengths: MLXArray? = nil) -> MLXArray { MLXArray(Float(0)) }
public func attentionWithCacheUpdate(queries: MLXArray, keys: MLXArray, values: MLXArray, cache: KVCache?, scale: Float, mask: MLXFast.ScaledDotProductAttentionMaskMode = .none) -> MLXArray { queries }
public protocol KVCacheAttentionProtocol: KVCache {
  func updateAndAttend(queries: MLXArray, keys: MLXArray, values: MLXArray, scale: Float, mask: MLXFast.ScaledDotProductAttentionMaskMode) -> MLXArray
}
