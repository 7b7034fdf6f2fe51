// PyLayer: replicas of a Python module bound to device tensors.
#include "python/py_layer.h"

#include <mutex>
#include <unordered_map>

#include "python/package_helpers.h"
#include "python/values.h"

namespace roundpipe {
namespace python {
namespace {

NamedTensors named_tensors(const py::object& names, const py::object& tensors) {
  NamedTensors out;
  auto n = names.cast<py::list>();
  auto t = tensors.cast<py::list>();
  for (size_t i = 0; i < n.size(); ++i) {
    out.emplace_back(n[i].cast<std::string>(), THPVariable_Unpack(t[i].ptr()));
  }
  return out;
}

std::vector<at::Tensor> tensor_list(const py::handle& list) {
  std::vector<at::Tensor> out;
  for (auto item : list) out.push_back(THPVariable_Unpack(item.ptr()));
  return out;
}

class PyModuleLayer final : public PyLayer {
 public:
  PyModuleLayer(const py::object& module, int64_t index) {
    py::object adapter = package_helpers().layer_adapter(module, index);
    adapter_ = SharedPyObject(adapter);
    type_name_ = adapter.attr("type_name").cast<std::string>();
    params_ = named_tensors(adapter.attr("param_names"), adapter.attr("params"));
    buffers_ = named_tensors(adapter.attr("buffer_names"), adapter.attr("buffers"));
    training_ = module.attr("training").cast<bool>();
  }

  std::string type_name() const override { return type_name_; }
  NamedTensors named_parameters() const override { return params_; }
  NamedTensors named_buffers() const override { return buffers_; }
  bool is_training() const override { return training_.load(); }

  void train(bool on) override {
    call_python([&] { adapter_.get().attr("module").attr("train")(on); });
    training_ = on;
  }

  void refresh_mode() override { training_ = adapter_.get().attr("module").attr("training").cast<bool>(); }

  std::vector<at::Tensor> bind(int replica, const std::vector<at::Tensor>& params,
                               const std::vector<at::Tensor>& buffers) override {
    Replica& r = replica_for(replica);
    TORCH_INTERNAL_ASSERT(params.size() == r.params.size() && buffers.size() == r.buffers.size());
    for (size_t i = 0; i < params.size(); ++i) {
      r.params[i].set_data(params[i]);
      r.params[i].requires_grad_(params_[i].second.requires_grad());
    }
    if (!buffers.empty()) {
      // A forward (or a recomputation, which does not read buffers back) may
      // have replaced buffers in the module: bind the module's own slots again.
      call_python([&] { r.obj.get().attr("restore_buffers")(); });
    }
    for (size_t i = 0; i < buffers.size(); ++i) r.buffers[i].set_data(buffers[i]);
    return r.params;
  }

  std::vector<at::Tensor> bound_buffers(int replica) override {
    Replica& r = replica_for(replica);
    if (r.buffers.empty()) return {};
    // A forward may have replaced a buffer (self.b = self.b + 1): read what the
    // module holds now, and put the bound variables back for the next job.
    return call_python([&] { return tensor_list(r.obj.get().attr("take_buffers")()); });
  }

  c10::IValue forward(int replica, std::vector<c10::IValue> args, Kwargs kwargs) override {
    Replica& r = replica_for(replica);
    return call_python([&] {
      py::object out = r.obj.get()(args_to_python(args), kwargs_to_python(kwargs));
      return to_ivalue(out);
    });
  }

  void unbind(int replica) override {
    Replica& r = replica_for(replica);
    release_replica_tensors(r.params, r.buffers);
  }

 private:
  struct Replica {
    SharedPyObject obj;  // roundpipe._layers.Replica
    std::vector<at::Tensor> params;
    std::vector<at::Tensor> buffers;
  };

  // Only device `replica`'s thread creates its replica; mu_ guards the map.
  Replica& replica_for(int replica) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = replicas_.find(replica);
      if (it != replicas_.end()) return it->second;
    }
    Replica made = call_python([&] {
      py::object obj = adapter_.get().attr("make_replica")();
      Replica r;
      r.params = tensor_list(obj.attr("params"));
      r.buffers = tensor_list(obj.attr("buffers"));
      r.obj = SharedPyObject(obj);
      return r;
    });
    std::lock_guard<std::mutex> lock(mu_);
    return replicas_.emplace(replica, std::move(made)).first->second;
  }

  SharedPyObject adapter_;  // roundpipe._layers.LayerAdapter
  std::string type_name_;
  NamedTensors params_;
  NamedTensors buffers_;
  std::atomic<bool> training_{true};
  std::mutex mu_;
  std::unordered_map<int, Replica> replicas_;  // guarded by mu_ (entries are stable)
};

}  // namespace

std::shared_ptr<PyLayer> make_py_layer(const py::object& module, int64_t index) {
  try {
    return std::make_shared<PyModuleLayer>(module, index);
  } catch (py::error_already_set& e) {
    e.restore();
    throw PythonError::fetch();
  }
}

}  // namespace python
}  // namespace roundpipe
