// Loading the shared parity vectors written by tools/make_swift_vectors.py
// (H2OCoreTests and MLXH2OTests replay the same files).

import Foundation
import H2OCore

public enum Vectors {
    public static let folder = URL(fileURLWithPath: #filePath)
        .deletingLastPathComponent().deletingLastPathComponent()
        .appendingPathComponent("Vectors")

    public static let format = "mlx-h2o-swift-vectors/1"

    /// Names of the stream files (every vector file but the config and kernel ones).
    public static var streamNames: [String] {
        let files = (try? FileManager.default.contentsOfDirectory(atPath: folder.path)) ?? []
        let others: Set = ["config_cases.json", "metal_kernels.json"]
        return files.filter { $0.hasSuffix(".json") && !others.contains($0) }.sorted()
    }

    public static func load(_ name: String, format: String = format) throws -> [String: Any] {
        let data = try Data(contentsOf: folder.appendingPathComponent(name))
        guard let doc = try JSONSerialization.jsonObject(with: data) as? [String: Any],
            doc["format"] as? String == format
        else { throw VectorError("\(name) is not a \(format) file") }
        return doc
    }
}

public struct VectorError: Error, CustomStringConvertible {
    public let description: String
    public init(_ description: String) { self.description = description }
}

/// Typed access to the JSON values of one record.
public struct Record {
    public let d: [String: Any]
    public init(_ any: Any?) throws {
        guard let d = any as? [String: Any] else { throw VectorError("not an object: \(any ?? "nil")") }
        self.d = d
    }

    public func int(_ key: String) throws -> Int {
        guard let v = d[key] as? Int else { throw VectorError("\(key) is not an int") }
        return v
    }

    public func optionalInt(_ key: String) -> Int? { d[key] as? Int }

    public func string(_ key: String) throws -> String {
        guard let v = d[key] as? String else { throw VectorError("\(key) is not a string") }
        return v
    }

    /// Floats; JSON null stands for -inf (masked logits).
    public func floats(_ key: String) throws -> [Float] {
        guard let v = d[key] as? [Any] else { throw VectorError("\(key) is not a list") }
        return v.map { ($0 as? NSNumber).map { Float($0.doubleValue) } ?? -.infinity }
    }

    /// (B, n_kv_heads, n) ints flattened to rows `b * n_kv_heads + h`.
    public func rows(_ key: String) throws -> [[Int32]]? {
        guard let v = d[key], !(v is NSNull) else { return nil }
        guard let batch = v as? [[[Int]]] else { throw VectorError("\(key) is not (B, H, n)") }
        return batch.flatMap { $0.map { $0.map(Int32.init) } }
    }

    /// (B, n_kv_heads) ints flattened to rows.
    public func perRow(_ key: String) throws -> [Int]? {
        guard let v = d[key], !(v is NSNull) else { return nil }
        guard let batch = v as? [[Int]] else { throw VectorError("\(key) is not (B, H)") }
        return batch.flatMap { $0 }
    }

    public func record(_ key: String) throws -> Record { try Record(d[key]) }

    public func records(_ key: String) throws -> [Record] {
        guard let v = d[key] as? [Any] else { throw VectorError("\(key) is not a list") }
        return try v.map(Record.init)
    }
}

extension H2OSlots {
    /// Slots configured as a vector stream describes.
    public init(stream: Record) throws {
        guard let config = stream.d["config"] as? [String: Any] else {
            throw VectorError("stream has no config")
        }
        try self.init(
            config: H2OConfig(dictionary: config), windowSize: stream.optionalInt("window_size"))
    }
}
