#include "util/contextual_error.h"

#include <c10/util/Exception.h>

#include <stdexcept>
#include <typeinfo>

namespace roundpipe {

namespace {

template <typename E>
[[noreturn]] void rethrow_as(const E& e, const std::string& context) {
  throw E(std::string(e.what()) + "\n" + context);
}

}  // namespace

void rethrow_with_context(std::exception_ptr error, const std::string& context) {
  try {
    std::rethrow_exception(error);
  } catch (c10::Error& e) {
    e.add_context(context);  // same object, same type
    throw;
  } catch (std::exception& e) {
    if (auto* contextual = dynamic_cast<ContextualError*>(&e)) {
      contextual->add_context(context);
      throw;
    }
    // Standard exceptions cannot take context in place: rebuild the common
    // ones with the context appended; rethrow anything else unchanged.
    const std::type_info& type = typeid(e);
    if (type == typeid(std::runtime_error)) rethrow_as(static_cast<const std::runtime_error&>(e), context);
    if (type == typeid(std::invalid_argument))
      rethrow_as(static_cast<const std::invalid_argument&>(e), context);
    if (type == typeid(std::out_of_range)) rethrow_as(static_cast<const std::out_of_range&>(e), context);
    if (type == typeid(std::logic_error)) rethrow_as(static_cast<const std::logic_error&>(e), context);
    if (type == typeid(std::domain_error)) rethrow_as(static_cast<const std::domain_error&>(e), context);
    if (type == typeid(std::range_error)) rethrow_as(static_cast<const std::range_error&>(e), context);
    if (type == typeid(std::overflow_error))
      rethrow_as(static_cast<const std::overflow_error&>(e), context);
    throw;
  }
}

}  // namespace roundpipe
