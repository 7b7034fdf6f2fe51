// Token data for python/roundpipe/data.py: token files, the batcher and the
// built-in corpus (roundpipe/token_data.h). TokenFile reads run without the
// GIL (TokenFile is thread-safe); TokenBatcher calls keep it (the batcher is
// thread-compatible, and the GIL is what serializes Python threads over it).
#include <optional>
#include <string>

#include "python/python_common.h"
#include "roundpipe/token_data.h"

namespace roundpipe {
namespace python {
namespace {

TokenFileOptions file_options(const std::optional<std::string>& dtype, int64_t vocab_size) {
  TokenFileOptions options;
  if (dtype) options.set_dtype(parse_token_dtype(*dtype));
  options.set_vocab_size(vocab_size);
  return options;
}

py::tuple to_tuple(const TokenBatch& batch) {
  return py::make_tuple(batch.input_ids, batch.labels);
}

}  // namespace

void bind_token_data(py::module_& m) {
  py::class_<TokenFile>(m, "TokenFile")
      .def(py::init([](const std::string& path, const std::optional<std::string>& dtype,
                       int64_t vocab_size) {
             TokenFileOptions options = file_options(dtype, vocab_size);
             py::gil_scoped_release nogil;
             return TokenFile(path, options);
           }),
           py::arg("path"), py::arg("dtype") = py::none(), py::arg("vocab_size") = 0)
      .def_static(
          "from_tensor",
          [](const at::Tensor& tokens, const std::string& name,
             const std::optional<std::string>& dtype, int64_t vocab_size) {
            return TokenFile::from_tensor(tokens, name, file_options(dtype, vocab_size));
          },
          py::arg("tokens"), py::arg("name") = "<memory>", py::arg("dtype") = py::none(),
          py::arg("vocab_size") = 0)
      .def_property_readonly("path", &TokenFile::path)
      .def_property_readonly("dtype",
                             [](const TokenFile& self) { return token_dtype_name(self.dtype()); })
      .def_property_readonly("vocab_size", &TokenFile::vocab_size)
      .def("size", &TokenFile::size)
      .def("__len__", &TokenFile::size)
      .def(
          "tokens",
          [](const TokenFile& self, int64_t begin, int64_t count) {
            at::Tensor out;
            {
              py::gil_scoped_release nogil;
              out = self.tokens(begin, count);
            }
            return out;
          },
          py::arg("begin"), py::arg("count"))
      .def("validate", [](const TokenFile& self) {
        py::gil_scoped_release nogil;
        self.validate();
      });

  py::class_<TokenBatcher>(m, "TokenBatcher")
      .def(py::init([](const TokenFile& data, int64_t seq_len, uint64_t seed, bool shuffle,
                       int64_t eval_windows, double eval_fraction) {
             return TokenBatcher(data, TokenBatcherOptions(seq_len)
                                           .seed(seed)
                                           .shuffle(shuffle)
                                           .eval_windows(eval_windows)
                                           .eval_fraction(eval_fraction));
           }),
           py::arg("data"), py::arg("seq_len"), py::arg("seed") = 0, py::arg("shuffle") = true,
           py::arg("eval_windows") = 0, py::arg("eval_fraction") = 0.0)
      .def_property_readonly("seq_len", &TokenBatcher::seq_len)
      .def_property_readonly("train_windows", &TokenBatcher::train_windows)
      .def_property_readonly("eval_windows", &TokenBatcher::eval_windows)
      .def_property_readonly("data", &TokenBatcher::data)
      .def(
          "next_batch",
          [](TokenBatcher& self, int64_t batch_size) {
            return to_tuple(self.next_batch(batch_size));
          },
          py::arg("batch_size"))
      .def("position",
           [](const TokenBatcher& self) {
             const DataPosition p = self.position();
             return py::make_tuple(p.seed, p.epoch, p.index);
           })
      .def(
          "seek",
          [](TokenBatcher& self, uint64_t seed, int64_t epoch, int64_t index) {
            self.seek(DataPosition{seed, epoch, index});
          },
          py::arg("seed"), py::arg("epoch"), py::arg("index"))
      .def(
          "eval_batches",
          [](const TokenBatcher& self, int64_t batch_size, int64_t max_batches) {
            py::list out;
            for (const TokenBatch& b : self.eval_batches(batch_size, max_batches)) {
              out.append(to_tuple(b));
            }
            return out;
          },
          py::arg("batch_size"), py::arg("max_batches") = 0)
      .def("window_at", &TokenBatcher::window_at, py::arg("seed"), py::arg("epoch"),
           py::arg("index"))
      .def("train_window_offset", &TokenBatcher::train_window_offset, py::arg("window"))
      .def("eval_window_offset", &TokenBatcher::eval_window_offset, py::arg("window"));

  m.def(
      "write_token_file",
      [](const std::string& path, const at::Tensor& tokens, const std::string& dtype) {
        const TokenDtype d = parse_token_dtype(dtype);
        py::gil_scoped_release nogil;
        write_token_file(path, tokens, d);
      },
      py::arg("path"), py::arg("tokens"), py::arg("dtype"));
  m.def("shuffled_order", &shuffled_order, py::arg("n"), py::arg("seed"), py::arg("epoch"));
  m.def(
      "encode_bytes", [](const py::bytes& data) { return encode_bytes(std::string(data)); },
      py::arg("data"));
  m.def(
      "decode_bytes", [](const at::Tensor& tokens) { return py::bytes(decode_bytes(tokens)); },
      py::arg("tokens"));
  m.def("default_corpus", [] { return std::string(default_corpus()); });
  m.def("default_token_data", &default_token_data);
  m.def("default_token_file", &default_token_file);
  m.attr("BYTE_VOCAB_SIZE") = kByteVocabSize;
}

}  // namespace python
}  // namespace roundpipe
