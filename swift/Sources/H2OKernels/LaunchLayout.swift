// Launch plans of the decode attention kernels (mirrors mlx_h2o/kernels/decode.py).

/// How one block maps a (sequence, KV head, row tile) onto threads.
public struct LaunchLayout: Equatable, Sendable {
    /// Query rows per block (divides G * L).
    public let rows: Int
    /// Row tiles per KV head.
    public let rowTiles: Int
    /// Lanes per key.
    public let lanesPerKey: Int
    /// Elements per lane.
    public let elementsPerLane: Int
    /// Keys each lane group loads per iteration (U).
    public let keysPerLaneGroup: Int
    /// Keys per block iteration (splits are multiples of it).
    public let tile: Int

    /// The layout for head dim `D`, element size `itemSize` bytes (unused: the
    /// layout no longer depends on it), GQA group `G`, `L` queries. A warp reads
    /// one key row, each lane EPL = 2, 4 or 8 elements; `U` 0 picks
    /// min(8, 32 / R rounded up to a power of two) keys per lane group.
    public init(D: Int, itemSize: Int, G: Int, L: Int, U: Int = KernelConstants.keysPerLaneGroup) {
        let epl = [2, 4, 8].first { 32 * $0 >= D && D % $0 == 0 } ?? 8
        let all = G * L
        let r = (1 ... KernelConstants.maxRows).last { all % $0 == 0 }!
        var padded = 1
        while padded < r { padded <<= 1 }  // rows padded to a power of two
        rows = r
        rowTiles = all / r
        lanesPerKey = 32
        elementsPerLane = epl
        keysPerLaneGroup = U != 0 ? U : min(8, 32 / padded)
        tile = (KernelConstants.threadsPerBlock / 32) * keysPerLaneGroup
    }

    /// Template constants shared by both passes (`T` is added by the caller).
    public func template(D: Int, L: Int, G: Int, kvHeads: Int) -> [(String, Int)] {
        [
            ("D", D), ("R", rows), ("L", L), ("G", G), ("HK", kvHeads), ("TPK", lanesPerKey),
            ("EPL", elementsPerLane), ("U", keysPerLaneGroup),
        ]
    }
}

/// Key splits per (sequence, KV head, row tile): fill the GPU, keep splits long.
/// Head dims above 128 target half the blocks (register-bound residency of
/// pass 1, measured on CUDA; decode.py).
public func chooseSplits(keys N: Int, units: Int, tile: Int, D: Int = 128) -> Int {
    if N <= KernelConstants.singlePassMaxN { return 1 }
    let byLength = (N + max(KernelConstants.minSplitKeys, tile) - 1) / max(KernelConstants.minSplitKeys, tile)
    let target = D <= 128 ? KernelConstants.targetBlocks : KernelConstants.targetBlocks / 2
    let byFill = (target + units - 1) / units
    return max(1, min(byLength, byFill, KernelConstants.maxSplits))
}

/// Key splits per row of the quantized attention: one pass up to
/// `quantizedSinglePassN` keys, else enough blocks to fill the GPU with at least
/// `quantizedMinSplitKeys` keys per split (quantized_gpu.py).
public func chooseQuantizedSplits(keys N: Int, rows: Int) -> Int {
    if N <= KernelConstants.quantizedSinglePassN { return 1 }
    let byLength = N / KernelConstants.quantizedMinSplitKeys
    let byFill = (KernelConstants.quantizedTargetBlocks + rows - 1) / rows
    return max(1, min(byLength, byFill, KernelConstants.quantizedMaxSplits))
}

/// The kernel's view of an array mask: kind and head mode (0 broadcast, 1 per
/// query head, 2 per KV head), or nil where the kernels do not take it.
/// `shape` is the mask's shape; `isBool` / `isFloat` its dtype class
/// (float16, bfloat16, float32 count as float).
public func kernelMask(
    shape: [Int], isBool: Bool, isFloat: Bool, B: Int, heads Hq: Int, kvHeads Hk: Int, L: Int,
    N: Int
) -> (kind: KernelMask, headMode: Int)? {
    guard (1 ... 4).contains(shape.count) else { return nil }
    let s = Array(repeating: 1, count: 4 - shape.count) + shape
    guard [1, B].contains(s[0]), [1, L].contains(s[2]), [1, N].contains(s[3]) else { return nil }
    // decode.py's {Hq: 1, Hk: 2, 1: 0}: on equal sizes the later entry wins.
    let mode: Int
    if s[1] == 1 { mode = 0 } else if s[1] == Hk { mode = 2 } else if s[1] == Hq { mode = 1 } else {
        return nil
    }
    if isBool { return (.bool, mode) }
    return isFloat ? (.add, mode) : nil
}
