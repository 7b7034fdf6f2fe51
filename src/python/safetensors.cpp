// Safetensors for python/roundpipe/safetensors.py: dicts of tensors in and
// out of roundpipe::save_safetensors / load_safetensors (and the sharded
// checkpoint functions). File I/O runs without the GIL.
#include <map>
#include <string>

#include "python/python_common.h"
#include "roundpipe/safetensors.h"

namespace roundpipe {
namespace python {
namespace {

NamedTensors to_named_tensors(const char* fn, const py::dict& tensors) {
  NamedTensors out;
  out.reserve(tensors.size());
  for (const auto& item : tensors) {
    TORCH_CHECK_TYPE(py::isinstance<py::str>(item.first), fn, ": tensor names must be str, got ",
                     py::str(py::type::of(item.first).attr("__name__")).cast<std::string>());
    const std::string name = item.first.cast<std::string>();
    TORCH_CHECK_TYPE(THPVariable_Check(item.second.ptr()), fn, ": the value of '", name,
                     "' must be a torch.Tensor, got ",
                     py::str(py::type::of(item.second).attr("__name__")).cast<std::string>());
    out.emplace_back(name, THPVariable_Unpack(item.second.ptr()));
  }
  return out;
}

std::map<std::string, std::string> to_metadata(const char* fn, const py::object& metadata) {
  std::map<std::string, std::string> out;
  if (metadata.is_none()) return out;
  TORCH_CHECK_TYPE(py::isinstance<py::dict>(metadata), fn,
                   ": metadata must be a dict[str, str] or None, got ",
                   py::str(py::type::of(metadata).attr("__name__")).cast<std::string>());
  for (const auto& item : metadata.cast<py::dict>()) {
    TORCH_CHECK_TYPE(py::isinstance<py::str>(item.first) && py::isinstance<py::str>(item.second),
                     fn, ": metadata must map str to str; got the entry ",
                     py::repr(item.first).cast<std::string>(), ": ",
                     py::repr(item.second).cast<std::string>());
    out.emplace(item.first.cast<std::string>(), item.second.cast<std::string>());
  }
  return out;
}

py::dict to_dict(const NamedTensors& named) {
  py::dict out;
  for (const auto& [name, tensor] : named) out[py::str(name)] = py::cast(tensor);
  return out;
}

}  // namespace

void bind_safetensors(py::module_& m) {
  m.def(
      "save_safetensors",
      [](const std::string& path, const py::dict& tensors, const py::object& metadata) {
        NamedTensors named = to_named_tensors("save_safetensors", tensors);
        auto meta = to_metadata("save_safetensors", metadata);
        py::gil_scoped_release nogil;
        save_safetensors(path, named, meta);
      },
      py::arg("path"), py::arg("tensors"), py::arg("metadata") = py::none());
  m.def(
      "load_safetensors",
      [](const std::string& path) {
        NamedTensors named;
        {
          py::gil_scoped_release nogil;
          named = load_safetensors(path);
        }
        return to_dict(named);
      },
      py::arg("path"));
  m.def(
      "load_safetensors_metadata",
      [](const std::string& path) {
        std::map<std::string, std::string> meta;
        {
          py::gil_scoped_release nogil;
          meta = SafetensorsFile(path).metadata();
        }
        return meta;
      },
      py::arg("path"));
  m.def(
      "save_safetensors_sharded",
      [](const std::string& dir, const py::dict& tensors, uint64_t max_shard_bytes,
         const py::object& metadata) {
        NamedTensors named = to_named_tensors("save_safetensors_sharded", tensors);
        auto meta = to_metadata("save_safetensors_sharded", metadata);
        py::gil_scoped_release nogil;
        return save_safetensors_sharded(dir, named, max_shard_bytes, meta);
      },
      py::arg("dir"), py::arg("tensors"), py::arg("max_shard_bytes"),
      py::arg("metadata") = py::none());
  m.def(
      "load_safetensors_checkpoint",
      [](const std::string& path) {
        NamedTensors named;
        {
          py::gil_scoped_release nogil;
          named = load_safetensors_checkpoint(path);
        }
        return to_dict(named);
      },
      py::arg("path"));
}

}  // namespace python
}  // namespace roundpipe
