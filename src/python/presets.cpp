// Presets for python/roundpipe/presets.py: DecoderConfig, the decoder's
// layers as NativeModules, Hugging Face names and the chunked loss.
#include <torch/nn/modules/container/sequential.h>

#include "python/native_module.h"
#include "python/values.h"
#include "roundpipe/layer.h"
#include "roundpipe/lora.h"
#include "roundpipe/presets.h"

namespace roundpipe {
namespace python {
namespace {

std::vector<std::pair<std::string, at::Tensor>> named(const torch::OrderedDict<std::string, at::Tensor>& d) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : d) out.emplace_back(item.key(), item.value());
  return out;
}

// A direct call from Python (outside RoundPipe): the module's own forward.
py::object native_forward(NativeModule& self, const py::tuple& args, const py::dict& kwargs) {
  auto a = args_to_ivalues(args);
  auto k = kwargs_to_ivalues(kwargs);
  c10::IValue out;
  {
    py::gil_scoped_release nogil;
    if (auto* value_layer = dynamic_cast<ValueLayer*>(self.any.ptr().get())) {
      out = value_layer->forward(std::move(a), std::move(k));
    } else {
      TORCH_CHECK_TYPE(a.size() == 1 && a[0].isTensor() && k.empty(), self.any.ptr()->name(),
                       " takes one tensor");
      out = self.any.forward(a[0].toTensor());
    }
  }
  return to_python(out);
}

py::list decoder_layers(const DecoderConfig& config) {
  torch::nn::Sequential net;
  {
    py::gil_scoped_release nogil;
    net = make_decoder(config);
  }
  py::list out;
  for (const auto& any : *net) out.append(NativeModule{any});
  return out;
}

// apply_lora over the layers of a Python preset (the same C++ modules).
int64_t apply_lora_py(const py::list& natives, const LoraConfig& config) {
  torch::nn::Sequential net;
  for (const auto& n : natives) net->push_back(n.cast<NativeModule&>().any);
  return apply_lora(net, config);
}

}  // namespace

c10::optional<torch::nn::AnyModule> native_module_of(const py::handle& module) {
  py::object native = py::getattr(module, "_roundpipe_native", py::none());
  if (native.is_none()) return c10::nullopt;
  return native.cast<NativeModule&>().any;
}

void bind_presets(py::module_& m) {
  py::class_<NativeModule>(m, "NativeModule")
      .def("type_name", [](const NativeModule& s) { return s.any.ptr()->name(); })
      .def("named_parameters", [](const NativeModule& s) { return named(s.any.ptr()->named_parameters()); })
      .def("named_buffers", [](const NativeModule& s) { return named(s.any.ptr()->named_buffers()); })
      .def("train", [](NativeModule& s, bool on) { s.any.ptr()->train(on); })
      .def("is_training", [](const NativeModule& s) { return s.any.ptr()->is_training(); })
      .def("forward", &native_forward);

  py::class_<DecoderConfig>(m, "DecoderConfig")
      .def(py::init<>())
      .def_readwrite("model_type", &DecoderConfig::model_type)
      .def_readwrite("vocab_size", &DecoderConfig::vocab_size)
      .def_readwrite("hidden_size", &DecoderConfig::hidden_size)
      .def_readwrite("intermediate_size", &DecoderConfig::intermediate_size)
      .def_readwrite("num_hidden_layers", &DecoderConfig::num_hidden_layers)
      .def_readwrite("num_attention_heads", &DecoderConfig::num_attention_heads)
      .def_readwrite("num_key_value_heads", &DecoderConfig::num_key_value_heads)
      .def_readwrite("head_dim", &DecoderConfig::head_dim)
      .def_readwrite("rms_norm_eps", &DecoderConfig::rms_norm_eps)
      .def_readwrite("rope_theta", &DecoderConfig::rope_theta)
      .def_readwrite("max_position_embeddings", &DecoderConfig::max_position_embeddings)
      .def_readwrite("tie_word_embeddings", &DecoderConfig::tie_word_embeddings)
      .def_readwrite("attention_bias", &DecoderConfig::attention_bias)
      .def_readwrite("mlp_bias", &DecoderConfig::mlp_bias)
      .def_readwrite("initializer_range", &DecoderConfig::initializer_range)
      .def_readwrite("loss_chunk_size", &DecoderConfig::loss_chunk_size)
      .def_property_readonly("rope_type", [](const DecoderConfig& c) { return c.rope_scaling.rope_type; })
      .def_property_readonly("head_size", &DecoderConfig::head_size)
      .def_property_readonly("kv_heads", &DecoderConfig::kv_heads)
      .def_property_readonly("qk_norm", &DecoderConfig::qk_norm)
      .def("validate", &DecoderConfig::validate);

  py::class_<LoraConfig>(m, "LoraConfig")
      .def(py::init<>())
      .def_readwrite("rank", &LoraConfig::rank)
      .def_readwrite("alpha", &LoraConfig::alpha)
      .def_readwrite("target_modules", &LoraConfig::target_modules)
      .def("validate", &LoraConfig::validate);
  m.def("apply_lora", &apply_lora_py);

  m.def("decoder_config_from_json", &from_hf_config_json);
  m.def("tiny_llama_config", &tiny_llama_config);
  m.def("tiny_qwen3_config", &tiny_qwen3_config);
  m.def("decoder_layers", &decoder_layers);
  m.def("hf_parameter_names", &hf_parameter_names);
  m.def("chunked_cross_entropy", &chunked_cross_entropy, py::arg("hidden"), py::arg("weight"),
        py::arg("labels"), py::arg("chunk_size") = 1024, py::arg("ignore_index") = -100,
        py::arg("sum_reduction") = false, py::call_guard<py::gil_scoped_release>());
}

}  // namespace python
}  // namespace roundpipe
