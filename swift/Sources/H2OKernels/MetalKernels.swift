// Assembly of the Metal kernel variants from the generated source pieces, as
// mlx_h2o/kernels/build.py and quantized_gpu.py do it. Pure Swift: `swift test`
// checks every variant against the Python package's text (metal_kernels.json).

/// One kernel variant ready for `MLXFast.metalKernel`.
public struct KernelVariant: Equatable, Sendable {
    public let name: String
    public let inputNames: [String]
    public let outputNames: [String]
    public let header: String
    public let body: String
}

/// How an attention mask reaches a kernel.
public enum KernelMask: String, CaseIterable, Sendable {
    case none, causal, bool, add

    var isArray: Bool { self == .bool || self == .add }
}

public enum MetalKernels {

    /// Pass 1 of the decode attention (`split`: partials for pass 2; `fused`: the
    /// H2O step's position / window handling and, without split, the fold).
    /// The fused step's parameters of one sequence (build.py `param_markers`):
    /// the launch's `prm_i`, no per-row flags. The rows variant (batched
    /// generation) is the Python package's only.
    static let sequenceParams = ["PRM": "prm_i", "FLAGS": "0"]

    public static func pass1(mask: KernelMask, sinks: Bool, split: Bool, fused: Bool) -> KernelVariant {
        let p = KernelSource.attention
        // With splits, pass 2 takes the sinks.
        var inputs = ["q", "k", "v", "prm_f"] + (mask.isArray ? ["mask"] : [])
        inputs += sinks && !split ? ["sinks"] : []
        if fused {
            inputs += ["pos_in", "slot", "prm_i"] + (split ? [] : ["score_in", "count_in", "pin"])
        }
        let outputs =
            split
            ? ["logits", "part_o", "part_ml"]
            : ["out", "logits", "lse"] + (fused ? ["pos_out", "score_out", "count_out", "victim"] : [])
        let tail = fused && !split ? p["FOLD_PASS1_LSE"]! + substitute(p["FOLD"]!, ["NV": "N", "NS": "NS", "VW": "D"].merging(sequenceParams) { $1 }) : ""
        let body = substitute(
            p["PASS1"]!,
            [
                "IDS": p["METAL_IDS"]!,
                "MASK_SETUP": mask.isArray ? p["MASK_SETUP"]! : "",
                "FUSED_SETUP": fused ? substitute(p["FUSED_SETUP"]!, sequenceParams) : "",
                "FUSED_KPOS": fused ? String(repeating: " ", count: 10) + p["FUSED_KPOS"]! : "",
                "MASK_APPLY": maskApply(mask, fused: fused),
                "SINK_INIT": sinks && !split ? p["SINK_INIT_PASS1"]! : "",
                "WRITE_ROW": split ? p["WRITE_PARTIAL"]! : p["WRITE_FINAL"]!,
                "RANGE": substitute(p["PASS1_RANGE"]!, ["NVALID": fused ? "prm_i[5]" : "NS"]),
                "KV_VEC": p["KV_VEC"]!,
                "TAIL": tail,
            ])
        let flags = "\(mask.rawValue)_\(bit(sinks))\(bit(split))\(bit(fused))"
        return variant("h2o_attn1_\(flags)", inputs, outputs, p["METAL_HEADER"]!, body)
    }

    /// Pass 2: merges the key splits (and runs the H2O fold when `fused`).
    public static func pass2(sinks: Bool, fused: Bool) -> KernelVariant {
        let p = KernelSource.attention
        var inputs = ["part_o", "part_ml"] + (sinks ? ["sinks"] : [])
        var outputs = ["out", "lse"]
        if fused {
            inputs += ["logits", "pos_in", "score_in", "count_in", "slot", "prm_i", "prm_f", "pin"]
            outputs += ["pos_out", "score_out", "count_out", "victim"]
        }
        let body = substitute(
            p["PASS2"]!,
            [
                "IDS": p["METAL_IDS"]!,
                "FUSED_ROWS": "  constexpr bool FUSED_ROWS = \(fused ? "true" : "false");",
                "SINK_MAX": sinks ? p["SINK_MAX_PASS2"]! : "",
                "SINK_SUM": sinks ? p["SINK_SUM_PASS2"]! : "",
                "TAIL": fused ? substitute(p["FOLD"]!, ["NV": "prm_i[5]", "NS": "logits_shape[3]", "VW": "D"].merging(sequenceParams) { $1 }) : "",
            ])
        return variant("h2o_attn2_\(bit(sinks))\(bit(fused))", inputs, outputs, p["METAL_HEADER"]!, body)
    }

    /// Pass 1 of the fused attention over quantized K/V (one or `two` precision
    /// segments; `split`: partials for ``quantizedMerge(sinks:)``, which then takes the sinks).
    public static func quantized(mask: KernelMask, sinks: Bool, two: Bool, split: Bool = false)
        -> KernelVariant
    {
        let q = KernelSource.quantized
        let ownSinks = sinks && !split
        let body = substitute(
            q["BODY"]!,
            [
                "IDS": KernelSource.attention["METAL_IDS"]!,
                "NT": String(KernelConstants.quantizedThreadsPerBlock),
                "N1": two ? "k1w_shape[2]" : "0",
                "SEG1_QDOT": two ? q["SEG1_QDOT"]! : "      dot = 0.0f;",
                "SEG1_QAXPY": two ? q["SEG1_QAXPY"]! : "",
                "MASK_SETUP": mask.isArray ? q["MASK_SETUP"]! : "",
                "MASK_APPLY": q["MASK_APPLY_\(mask.rawValue)"]!,
                "SINK_MAX": ownSinks ? q["SINK_MAX"]! : "",
                "SINK_SUM": ownSinks ? q["SINK_SUM"]! : "",
                "WRITE": split ? q["WRITE_PARTIAL"]! : q["WRITE_FINAL"]!,
            ])
        var inputs = ["q"]
        for i in two ? [0, 1] : [0] {
            for x in ["k", "v"] { inputs += ["w", "s", "b"].map { "\(x)\(i)\($0)" } }
        }
        inputs += (mask.isArray ? ["mask"] : []) + (ownSinks ? ["sinks"] : [])
        let outputs = split ? ["logits", "part_o", "part_lse"] : ["out", "logits", "lse"]
        let header = KernelSource.attention["METAL_HEADER"]! + q["QHEADER"]!
        let flags = "\(mask.rawValue)_\(bit(sinks))\(bit(two))\(bit(split))"
        return variant("h2o_qattn_\(flags)", inputs, outputs, header, body)
    }

    /// Merges the key splits of the quantized attention (a block per row).
    public static func quantizedMerge(sinks: Bool) -> KernelVariant {
        let q = KernelSource.quantized
        let body = substitute(
            q["MERGE"]!,
            [
                "IDS": KernelSource.attention["METAL_IDS"]!,
                "NT": String(KernelConstants.quantizedThreadsPerBlock),
                "SINK_MAX": sinks ? q["SINK_MAX"]! : "",
                "SINK_SUM": sinks ? q["SINK_SUM"]! : "",
            ])
        return variant(
            "h2o_qattn_merge_\(bit(sinks))", ["q", "part_o", "part_lse"] + (sinks ? ["sinks"] : []),
            ["out", "lse"], KernelSource.attention["METAL_HEADER"]!, body)
    }

    /// FNV-1a 64 of the UTF-8 bytes, as hex (the generator's check hash).
    public static func fnv1a64(_ text: String) -> String {
        var h: UInt64 = 0xCBF2_9CE4_8422_2325
        for byte in text.utf8 { h = (h ^ UInt64(byte)) &* 0x0000_0100_0000_01B3 }
        let hex = String(h, radix: 16)
        return String(repeating: "0", count: 16 - hex.count) + hex
    }

    private static func variant(
        _ name: String, _ inputs: [String], _ outputs: [String], _ header: String, _ body: String
    ) -> KernelVariant {
        // MLX caches compiled kernels by name: the source hash goes in it.
        let digest = String(fnv1a64(header + "\u{0}" + body).prefix(10))
        return KernelVariant(
            name: "\(name)_\(digest)", inputNames: inputs, outputNames: outputs, header: header,
            body: body)
    }

    private static func bit(_ b: Bool) -> String { b ? "1" : "0" }

    private static func maskApply(_ mask: KernelMask, fused: Bool) -> String {
        let p = KernelSource.attention
        let code: [KernelMask: String] = [
            .causal: p["MASK_CAUSAL"]!, .bool: p["MASK_BOOL"]!, .add: p["MASK_ADD"]!,
        ]
        var lines = code[mask].map { [$0] } ?? []
        if fused { lines.append(p["MASK_WINDOW"]!) }
        return lines.map { String(repeating: " ", count: 14) + $0 }.joined(separator: "\n")
    }

    /// Python's `string.Template.substitute`: `$name` / `${name}` from `values`,
    /// `$$` is a dollar; an unknown name is a programming error.
    static func substitute(_ template: String, _ values: [String: String]) -> String {
        var out = ""
        var chars = Substring(template)
        let isStart = { (c: Character) in c == "_" || (c.isASCII && c.isLetter) }
        let isPart = { (c: Character) in isStart(c) || (c.isASCII && c.isNumber) }
        while let i = chars.firstIndex(of: "$") {
            out += chars[..<i]
            chars = chars[chars.index(after: i)...]
            if chars.first == "$" {
                out += "$"
                chars = chars.dropFirst()
                continue
            }
            let braced = chars.first == "{"
            if braced { chars = chars.dropFirst() }
            guard let first = chars.first, isStart(first) else {
                preconditionFailure("invalid $ placeholder in kernel template")
            }
            let name = String(chars.prefix(while: isPart))
            chars = chars.dropFirst(name.count)
            if braced {
                precondition(chars.first == "}", "unterminated ${ in kernel template")
                chars = chars.dropFirst()
            }
            guard let value = values[name] else { preconditionFailure("no value for $\(name)") }
            out += value
        }
        return out + chars
    }
}
