// Stubs of the mlx-swift API surface MLXH2O uses, for type-checking only:
// signatures as read from mlx-swift (see docs/SWIFT.md), bodies empty.
public enum DType: Hashable { case bool, int32, int64, uint32, float16, bfloat16, float32
  public var size: Int { 4 } }
public protocol ScalarOrArray {}
extension Float: ScalarOrArray {}
extension Int: ScalarOrArray {}
extension Int32: ScalarOrArray {}
extension Int64: ScalarOrArray {}
extension Bool: ScalarOrArray {}
extension MLXArray: ScalarOrArray {}
public protocol MLXArrayIndex {}
extension Int: MLXArrayIndex {}
extension Range<Int>: MLXArrayIndex {}
extension PartialRangeFrom<Int>: MLXArrayIndex {}
extension PartialRangeUpTo<Int>: MLXArrayIndex {}
public struct MLXEllipsisIndex: MLXArrayIndex { let k: Int }
extension MLXArrayIndex where Self == MLXEllipsisIndex {
  public static var ellipsis: MLXEllipsisIndex { MLXEllipsisIndex(k: 0) }
  public static var newAxis: MLXEllipsisIndex { MLXEllipsisIndex(k: 1) }
}
public protocol Evaluatable { func innerState() -> [MLXArray] }
public final class MLXArray {
  public init(_ v: [Float]) {}
  public init(_ v: [Int32]) {}
  public init(_ r: Range<Int32>) {}
  public init(_ v: Float) {}
  public init(_ v: Int32) {}
  public init(_ v: Int64) {}
  public func dim(_ i: Int) -> Int { 0 }
  public var ndim: Int { 0 }
  public var shape: [Int] { [] }
  public var dtype: DType { .float32 }
  public var nbytes: Int { 0 }
  public var size: Int { 0 }
  public func reshaped(_ s: Int...) -> MLXArray { self }
  public func reshaped(_ s: [Int]) -> MLXArray { self }
  public func asType(_ t: DType) -> MLXArray { self }
  public func sum(axis: Int, keepDims: Bool = false) -> MLXArray { self }
  public func mean(axis: Int, keepDims: Bool = false) -> MLXArray { self }
  public func max(axis: Int, keepDims: Bool = false) -> MLXArray { self }
  public func item<T>(_ type: T.Type) -> T { fatalError("stub") }
  public func swappedAxes(_ a: Int, _ b: Int) -> MLXArray { self }
  public subscript(_ i: MLXArrayIndex...) -> MLXArray { get { self } set {} }
  public static func zeros(_ s: [Int], dtype: DType = .float32) -> MLXArray { MLXArray(Float(0)) }
  public static func + <T: ScalarOrArray>(a: MLXArray, b: T) -> MLXArray { a }
  public static func + <T: ScalarOrArray>(a: T, b: MLXArray) -> MLXArray { b }
  public static func - <T: ScalarOrArray>(a: MLXArray, b: T) -> MLXArray { a }
  public static func - <T: ScalarOrArray>(a: T, b: MLXArray) -> MLXArray { b }
  public static func * <T: ScalarOrArray>(a: MLXArray, b: T) -> MLXArray { a }
  public static func * <T: ScalarOrArray>(a: T, b: MLXArray) -> MLXArray { b }
  public static func / <T: ScalarOrArray>(a: MLXArray, b: T) -> MLXArray { a }
  public static func + (a: MLXArray, b: MLXArray) -> MLXArray { a }
  public static func - (a: MLXArray, b: MLXArray) -> MLXArray { a }
  public static func * (a: MLXArray, b: MLXArray) -> MLXArray { a }
  public static func / (a: MLXArray, b: MLXArray) -> MLXArray { a }
  public static func .> (a: MLXArray, b: MLXArray) -> MLXArray { a }
  public static func .< (a: MLXArray, b: MLXArray) -> MLXArray { a }
  public static func .>= (a: MLXArray, b: MLXArray) -> MLXArray { a }
  public static func .<= (a: MLXArray, b: MLXArray) -> MLXArray { a }
  public static func .== (a: MLXArray, b: MLXArray) -> MLXArray { a }
  public static prefix func - (a: MLXArray) -> MLXArray { a }
  public static func .> <T: ScalarOrArray>(a: MLXArray, b: T) -> MLXArray { a }
  public static func .< <T: ScalarOrArray>(a: MLXArray, b: T) -> MLXArray { a }
  public static func .>= <T: ScalarOrArray>(a: MLXArray, b: T) -> MLXArray { a }
  public static func .<= <T: ScalarOrArray>(a: MLXArray, b: T) -> MLXArray { a }
  public static func .== <T: ScalarOrArray>(a: MLXArray, b: T) -> MLXArray { a }
  public static func & (a: MLXArray, b: MLXArray) -> MLXArray { a }
  public static func | (a: MLXArray, b: MLXArray) -> MLXArray { a }
}
infix operator .> : ComparisonPrecedence
infix operator .< : ComparisonPrecedence
infix operator .>= : ComparisonPrecedence
infix operator .<= : ComparisonPrecedence
infix operator .== : ComparisonPrecedence
public func which(_ c: MLXArray, _ a: MLXArray, _ b: MLXArray) -> MLXArray { a }
public func abs(_ a: MLXArray) -> MLXArray { a }
public func exp(_ a: MLXArray) -> MLXArray { a }
public func log(_ a: MLXArray) -> MLXArray { a }
public func maximum(_ a: MLXArray, _ b: MLXArray) -> MLXArray { a }
public func expandedDimensions(_ a: MLXArray, axis: Int) -> MLXArray { a }
public func broadcast(_ a: MLXArray, to: [Int]) -> MLXArray { a }
public func view(_ a: MLXArray, dtype: DType) -> MLXArray { a }
public func argMin(_ a: MLXArray, axis: Int, keepDims: Bool = false) -> MLXArray { a }
public func concatenated(_ a: [MLXArray], axis: Int = 0) -> MLXArray { a[0] }
public func argSort(_ a: MLXArray, axis: Int) -> MLXArray { a }
public func takeAlong(_ a: MLXArray, _ i: MLXArray, axis: Int) -> MLXArray { a }
public func putAlong(_ a: MLXArray, _ i: MLXArray, values: MLXArray, axis: Int) -> MLXArray { a }
public func matmul(_ a: MLXArray, _ b: MLXArray) -> MLXArray { a }
public func depends(input: MLXArray, dependencies: [MLXArray]) -> MLXArray { input }
public func quantized(_ w: MLXArray, groupSize: Int = 64, bits: Int = 4) -> (wq: MLXArray, scales: MLXArray, biases: MLXArray?) { (w, w, w) }
public func dequantized(_ w: MLXArray, scales: MLXArray, biases: MLXArray?, groupSize: Int = 64, bits: Int = 4) -> MLXArray { w }
public enum MLXFast {
  public enum ScaledDotProductAttentionMaskMode {
    case none, array(MLXArray)
    @available(*, deprecated) case arrays([MLXArray])
    case causal
    public var mask: MLXArray? { nil }
  }
  public static func scaledDotProductAttention(queries: MLXArray, keys: MLXArray, values: MLXArray, scale: Float, mask: ScaledDotProductAttentionMaskMode, sinks: MLXArray? = nil) -> MLXArray { queries }
}

public protocol KernelTemplateArg {}
extension Int: KernelTemplateArg {}
extension Bool: KernelTemplateArg {}
extension DType: KernelTemplateArg {}
public final class Device: Equatable {
  public static let gpu = Device(); public static let cpu = Device()
  public static func defaultDevice() -> Device { gpu }
  public static func == (a: Device, b: Device) -> Bool { a === b }
}
extension MLXFast {
  open class MLXFastKernel {
    public func callAsFunction(_ inputs: [ScalarOrArray], template: [(String, KernelTemplateArg)]? = nil, grid: (Int, Int, Int), threadGroup: (Int, Int, Int), outputShapes: [[Int]], outputDTypes: [DType], initValue: Float? = nil, verbose: Bool = false) -> [MLXArray] { [] }
  }
  public static func metalKernel(name: String, inputNames: [String], outputNames: [String], source: String, header: String = "", ensureRowContiguous: Bool = true, atomicOutputs: Bool = false) -> MLXFastKernel { MLXFastKernel() }
}
