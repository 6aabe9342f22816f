// Trim, serialization and copy of an H2OKVCache, in the Python package's
// layout: state = storage arrays + (positions, score, count); metaState =
// (offset, evicted, window, model name, config JSON[, storage metadata]).

import Foundation
import H2OCore
import MLX
import MLXLMCommon

extension H2OKVCache {

    public var isTrimmable: Bool { true }

    /// Forgets the newest `n` tokens (those still held), at any point: rows
    /// that evicted different tokens keep their best slots, as many as the
    /// fewest any row has left.
    @discardableResult
    public func trim(_ n: Int) -> Int {
        let before = ledger.size
        switch ledger.trim(n) {
        case .truncate(let k):
            return k  // slots are in token order until the first eviction
        case .regather(let k, let cut):
            let pos = positions![.ellipsis, ..<before]
            let gone = pos .>= cut
            let most = gone.asType(.int32).sum(axis: -1).reshaped([-1]).max(axis: 0)
            let size = before - Int(most.item(Int32.self))
            let pri = H2OPolicy.sinksFirst(
                priorities: priorities(offset: cut, n: before), positions: pos,
                sinkSize: config.sinkSize)
            gather(H2OPolicy.selectKeep(priorities: pri, positions: pos, k: size, drop: gone),
                n: before)
            ledger.regathered(size: size)
            return k
        }
    }

    public var state: [MLXArray] {
        get {
            guard let positions, let score, let count else { return [] }
            let n = size
            return storage.state(n)
                + [positions, score, count].map { $0[.ellipsis, ..<n] }
        }
        set {
            guard !newValue.isEmpty else {
                (positions, score, count) = (nil, nil, nil)
                storage.setState([])
                ledger.restore(offset: ledger.offset, evicted: ledger.evicted, size: 0)
                return
            }
            let meta = newValue.suffix(3).map { $0 }
            storage.setState(Array(newValue.dropLast(3)))
            (positions, score, count) = (meta[0], meta[1], meta[2])
            ledger.restore(offset: ledger.offset, evicted: ledger.evicted, size: meta[0].dim(2))
        }
    }

    public var metaState: [String] {
        get {
            [
                String(offset), String(ledger.evicted), windowSize.map(String.init) ?? "",
                modelName, config.json,
            ] + storage.metaState
        }
        set {
            precondition(newValue.count >= 5, "H2OKVCache metaState has 5 entries, got \(newValue)")
            guard let offset = Int(newValue[0]), let evicted = Int(newValue[1]) else {
                fatalError("H2OKVCache metaState offsets are not integers: \(newValue)")
            }
            do {
                let config = try H2OConfig(json: newValue[4])
                ledger = try SlotLedger(config: config, windowSize: Int(newValue[2]))
                try storage.setMetaState(Array(newValue.dropFirst(5)))
            } catch {
                fatalError("H2OKVCache metaState: \(error)")
            }
            modelName = newValue[3]
            ledger.restore(offset: offset, evicted: evicted, size: positions?.dim(2) ?? 0)
        }
    }

    /// A cache saved by `state`/`metaState` (in Swift or by the Python package).
    public static func fromState(state: [MLXArray], metaState: [String], storage: H2OSlotStorage)
        throws -> H2OKVCache
    {
        let config = try H2OConfig(json: metaState[4])
        let cache = try H2OKVCache(config: config, storage: storage)
        cache.metaState = metaState
        cache.state = state
        return cache
    }
}
