// QuantizedH2OKVCache: the H2O bookkeeping over affine-quantized K/V slots
// (mirrors QuantizedH2OKVCache in mlx_h2o/cache/quantized.py, one width).

import H2OCore
import MLX
import MLXLMCommon

/// H2O cache whose K/V slots hold MLX affine-quantized triples at `bits`.
///
/// Eviction bounds the tokens kept, quantization shrinks each; positions,
/// scores, victims, compaction and trim are the dense cache's. `update` returns
/// dequantized keys/values; the routed attention reads the triples itself.
public final class QuantizedH2OKVCache: H2OKVCache {
    public let bits: Int
    public let groupSize: Int

    public init(config: H2OConfig, windowSize: Int? = nil, bits: Int = 8, groupSize: Int = 64)
        throws
    {
        (self.bits, self.groupSize) = (bits, groupSize)
        try super.init(
            config: config, windowSize: windowSize,
            storage: QuantizedSlots(bits: bits, groupSize: groupSize))
    }

    public override func copy() -> any KVCache {
        copyInto(try! QuantizedH2OKVCache(
            config: config, windowSize: windowSize, bits: bits, groupSize: groupSize))
    }
}
