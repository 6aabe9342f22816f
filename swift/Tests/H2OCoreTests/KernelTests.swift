// The Metal kernels Swift assembles are the Python package's, byte for byte
// (metal_kernels.json, written by swift/scripts/make_metal_source.py), and so
// are the launch plans.

import H2OKernels
import H2OVectors
import Testing

@Suite("Metal kernel source")
struct KernelTests {
    let doc = try! Record(Vectors.load("metal_kernels.json", format: "mlx-h2o-metal-kernels/1"))

    func assemble(_ v: Record) throws -> KernelVariant {
        let sinks = v.d["sinks"] as! Bool
        switch try v.string("kind") {
        case "pass1":
            return MetalKernels.pass1(
                mask: KernelMask(rawValue: try v.string("mask"))!, sinks: sinks,
                split: v.d["split"] as! Bool, fused: v.d["fused"] as! Bool)
        case "pass2":
            return MetalKernels.pass2(sinks: sinks, fused: v.d["fused"] as! Bool)
        case "quantized_merge":
            return MetalKernels.quantizedMerge(sinks: sinks)
        default:
            return MetalKernels.quantized(
                mask: KernelMask(rawValue: try v.string("mask"))!, sinks: sinks,
                two: v.d["two"] as! Bool, split: v.d["split"] as! Bool)
        }
    }

    @Test("every variant: same header, body and argument names as Python")
    func variants() throws {
        let variants = try doc.records("variants")
        #expect(variants.count == 32 + 4 + 32 + 2)  // pass 1, pass 2, quantized, merge
        for v in variants {
            let k = try assemble(v)
            let at = "\(v.d)".prefix(80)
            #expect(k.inputNames == v.d["inputs"] as? [String], "\(at)")
            #expect(k.outputNames == v.d["outputs"] as? [String], "\(at)")
            #expect(k.header.count == (try v.int("header_len")), "\(at)")
            #expect(MetalKernels.fnv1a64(k.header) == (try v.string("header_fnv")), "\(at)")
            #expect(k.body.count == (try v.int("body_len")), "\(at)")
            #expect(MetalKernels.fnv1a64(k.body) == (try v.string("body_fnv")), "\(at)")
        }
    }

    @Test("launch layouts, split counts and mask modes match decode.py")
    func launchPlans() throws {
        for r in try doc.records("layouts") {
            let lay = LaunchLayout(
                D: try r.int("D"), itemSize: try r.int("itemsize"), G: try r.int("G"), L: try r.int("L"))
            let want = try ["R", "RT", "TPK", "EPL", "U", "tile"].map { try r.int($0) }
            let got = [lay.rows, lay.rowTiles, lay.lanesPerKey, lay.elementsPerLane, lay.keysPerLaneGroup, lay.tile]
            #expect(got == want, "\(r.d)")
        }
        for r in try doc.records("splits") {
            let s = chooseSplits(
                keys: try r.int("N"), units: try r.int("units"), tile: try r.int("tile"), D: try r.int("D"))
            #expect(s == (try r.int("S")), "\(r.d)")
        }
        for r in try doc.records("quantized_splits") {
            let s = chooseQuantizedSplits(keys: try r.int("N"), rows: try r.int("rows"))
            #expect(s == (try r.int("S")), "\(r.d)")
        }
        for r in try doc.records("mask_modes") {
            let dtype = try r.string("dtype")
            let got = kernelMask(
                shape: r.d["shape"] as! [Int], isBool: dtype == "bool", isFloat: dtype.hasPrefix("float"),
                B: try r.int("B"), heads: try r.int("Hq"), kvHeads: try r.int("Hk"), L: try r.int("L"),
                N: try r.int("N"))
            let want = r.d["mode"] as? [Any]
            #expect(got?.kind.rawValue == want?[0] as? String, "\(r.d)")
            #expect(got?.headMode == want?[1] as? Int, "\(r.d)")
        }
    }

    @Test("FNV-1a 64 gives the reference values")
    func fnv() {
        #expect(MetalKernels.fnv1a64("") == "cbf29ce484222325")
        #expect(MetalKernels.fnv1a64("a") == "af63dc4c8601ec8c")
    }
}
