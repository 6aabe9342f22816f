// Tape: replays a recorded graph of MLX primitives on new input arrays.
//
// What mx.compile's replay does for a launch of custom kernels, without its
// Python tree handling: on an H200 host that handling cost 2.5-5 us of a
// decode-attention call (3 outputs) against 1-1.7 us for MLX's whole SDPA
// call (docs/GPU.md, session 20). A Tape is recorded from one plain call
// (its inputs and outputs); calling it builds the same primitives on the new
// inputs with array::make_arrays, as mlx/compile.cpp's compile_replace does.
// The primitives are shared between calls, as compiled replays share them.
// Arrays of the recording that do not depend on an input are kept as
// constants (mx.compile's rule for captured arrays).
//
// Nothing here throws: a C++ exception crossing into MLX's nanobind (whose
// backend this module shares) crashed the process on the CUDA machine. A call
// whose inputs differ from the recording returns None; record() returns None
// where a Tape cannot tell its inputs apart (one array passed twice).

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <unordered_map>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace {

struct Node {
  std::shared_ptr<mx::Primitive> primitive;
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  std::vector<int> args;  // indices into a call's value table
};

class Tape {
 public:
  Tape(const std::vector<mx::array>& inputs,
       const std::vector<mx::array>& outputs) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!index_.emplace(inputs[i].id(), int(i)).second) {
        valid_ = false;
        return;
      }
      in_shapes_.push_back(inputs[i].shape());
      in_dtypes_.push_back(inputs[i].dtype());
    }
    // Value table of a call: inputs, then constants, then node outputs
    // (node indices are offset by the constant count once it is known).
    for (auto& out : outputs) {
      visit(out);
    }
    const int shift = int(constants_.size());
    for (auto& node : nodes_) {
      for (auto& a : node.args) {
        a = resolve(a, shift);
      }
    }
    for (auto& out : outputs) {
      outputs_.push_back(resolve(ref(out), shift));
    }
    index_.clear();
    depends_.clear();
  }

  bool valid() const {
    return valid_;
  }

  nb::object call(nb::args args) const {
    const size_t n_in = in_shapes_.size();
    if (args.size() != n_in) {
      return nb::none();
    }
    std::vector<mx::array> values;
    values.reserve(n_in + constants_.size() + n_values_);
    for (size_t i = 0; i < n_in; ++i) {
      nb::handle h = args[i];
      if (!nb::isinstance<mx::array>(h)) {
        return nb::none();
      }
      const auto& x = nb::cast<const mx::array&>(h);
      if (x.dtype() != in_dtypes_[i] || x.shape() != in_shapes_[i]) {
        return nb::none();
      }
      values.push_back(x);
    }
    values.insert(values.end(), constants_.begin(), constants_.end());
    for (const auto& node : nodes_) {
      std::vector<mx::array> in;
      in.reserve(node.args.size());
      for (int a : node.args) {
        in.push_back(values[a]);
      }
      auto outs =
          mx::array::make_arrays(node.shapes, node.dtypes, node.primitive, in);
      for (auto& o : outs) {
        values.push_back(std::move(o));
      }
    }
    nb::tuple result = nb::steal<nb::tuple>(PyTuple_New(outputs_.size()));
    for (size_t i = 0; i < outputs_.size(); ++i) {
      PyTuple_SET_ITEM(
          result.ptr(), i, nb::cast(values[outputs_[i]]).release().ptr());
    }
    return result;
  }

  size_t num_nodes() const {
    return nodes_.size();
  }

 private:
  // Before the shift: >= 0 input index, <= -1 constant -(c + 1), node values
  // as kNode + position.
  static constexpr int kNode = 1 << 24;

  int resolve(int a, int shift) const {
    const int n_in = int(in_shapes_.size());
    if (a >= kNode) {
      return n_in + shift + (a - kNode);
    }
    if (a < 0) {
      return n_in + (-a - 1);
    }
    return a;
  }

  bool depends(const mx::array& x) {
    auto it = depends_.find(x.id());
    if (it != depends_.end()) {
      return it->second;
    }
    bool d = index_.count(x.id()) > 0;
    if (!d && x.has_primitive()) {
      for (auto& in : x.inputs()) {
        d = depends(in) || d;
      }
    }
    depends_[x.id()] = d;
    return d;
  }

  // The table reference of x, recording its node (after its inputs) if new.
  int ref(const mx::array& x) {
    auto it = index_.find(x.id());
    if (it != index_.end()) {
      return it->second;
    }
    if (!depends(x)) {
      constants_.push_back(x);
      const int c = -int(constants_.size());
      index_.emplace(x.id(), c);
      return c;
    }
    visit(x);
    return index_.at(x.id());
  }

  void visit(const mx::array& x) {
    if (index_.count(x.id()) || !depends(x)) {
      ref(x);
      return;
    }
    Node node{x.primitive_ptr(), {}, {}, {}};
    for (auto& in : x.inputs()) {
      node.args.push_back(ref(in));
    }
    for (auto& o : x.outputs()) {  // this array and its siblings, in order
      index_.emplace(o.id(), kNode + int(n_values_++));
      node.shapes.push_back(o.shape());
      node.dtypes.push_back(o.dtype());
    }
    nodes_.push_back(std::move(node));
  }

  std::vector<mx::Shape> in_shapes_;
  std::vector<mx::Dtype> in_dtypes_;
  std::vector<mx::array> constants_;
  std::vector<Node> nodes_;
  std::vector<int> outputs_;
  size_t n_values_ = 0;
  bool valid_ = true;
  std::unordered_map<std::uintptr_t, int> index_;  // recording only
  std::unordered_map<std::uintptr_t, bool> depends_;  // recording only
};

} // namespace

NB_MODULE(_replay, m) {
  nb::class_<Tape>(m, "Tape")
      .def("__call__", &Tape::call)
      .def_prop_ro("num_nodes", &Tape::num_nodes);
  m.def(
      "record",
      [](const std::vector<mx::array>& inputs,
         const std::vector<mx::array>& outputs) -> nb::object {
        auto tape = std::make_unique<Tape>(inputs, outputs);
        if (!tape->valid()) {
          return nb::none();
        }
        return nb::cast(tape.release(), nb::rv_policy::take_ownership);
      },
      "inputs"_a,
      "outputs"_a);
}
