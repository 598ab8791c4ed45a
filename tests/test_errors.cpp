// The one exception <-> dfa_status mapping (include/deferalloc/core/errors.hpp).
#include <deferalloc/core/errors.hpp>

#include <gtest/gtest.h>

#include <new>
#include <string>

using namespace deferalloc;

namespace {
template <typename E>
std::exception_ptr make(const char* msg) {
  return std::make_exception_ptr(E(msg));
}
}  // namespace

TEST(Errors, StatusOfEachClassIsItsOwn) {
  EXPECT_EQ(status_of(nullptr), DFA_SUCCESS);
  EXPECT_EQ(status_of(make<invalid_argument>("a")), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of(make<invalid_state>("a")), DFA_ERROR_INVALID_STATE);
  EXPECT_EQ(status_of(make<out_of_memory>("a")), DFA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(status_of(make<cuda_error>("a")), DFA_ERROR_CUDA);
  EXPECT_EQ(status_of(make<no_device>("a")), DFA_ERROR_NO_DEVICE);  // not its base's
  EXPECT_EQ(status_of(make<io_error>("a")), DFA_ERROR_IO);
  EXPECT_EQ(status_of(make<corrupt_data>("a")), DFA_ERROR_CORRUPT);
  EXPECT_EQ(status_of(make<error>("a")), DFA_ERROR_INTERNAL);
  EXPECT_EQ(status_of(std::make_exception_ptr(std::bad_alloc())), DFA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(status_of(std::make_exception_ptr(std::runtime_error("x"))), DFA_ERROR_INTERNAL);
  EXPECT_EQ(status_of(std::make_exception_ptr(42)), DFA_ERROR_INTERNAL);
}

TEST(Errors, ThrowStatusRoundTrips) {
  for (int st = DFA_ERROR_INVALID_ARGUMENT; st <= DFA_ERROR_INTERNAL; ++st) {
    std::exception_ptr e;
    try {
      throw_status(static_cast<dfa_status>(st), "msg " + std::to_string(st));
    } catch (const error& x) {
      e = std::current_exception();
      EXPECT_EQ(std::string(x.what()), "msg " + std::to_string(st));
    }
    ASSERT_TRUE(e);
    EXPECT_EQ(status_of(e), st);
  }
  EXPECT_THROW(throw_status(DFA_SUCCESS, "x"), invalid_argument);
  EXPECT_THROW(throw_status(static_cast<dfa_status>(99), "x"), error);
}

TEST(Errors, RethrowWithContextKeepsTheClassAndNestsTheCause) {
  try {
    try {
      throw invalid_state("the cause");
    } catch (...) {
      rethrow_with_context("step failed at w");
    }
  } catch (const invalid_state& e) {
    EXPECT_EQ(std::string(e.what()), "step failed at w: the cause");
    const auto* nested = dynamic_cast<const std::nested_exception*>(&e);
    ASSERT_NE(nested, nullptr);
    EXPECT_THROW(nested->rethrow_nested(), invalid_state);
    return;
  } catch (...) {
    FAIL() << "not an invalid_state";
  }
  FAIL() << "nothing thrown";
}

TEST(Errors, RethrowWithContextOfAStoredException) {
  const std::exception_ptr e = make<no_device>("no GPU");
  EXPECT_THROW(rethrow_with_context("deregister_buffers", e), no_device);
  EXPECT_THROW(rethrow_with_context("x", std::make_exception_ptr(std::runtime_error("y"))), error);
  EXPECT_EQ(message_of(std::make_exception_ptr(std::bad_alloc())), "host memory exhausted");
  EXPECT_EQ(message_of(std::make_exception_ptr(7)), "unknown exception");
  EXPECT_EQ(message_of(nullptr), "");
}
