// The C++ API in one include.
#pragma once
#include <deferalloc/core/chunk_pool.hpp>
#include <deferalloc/core/config.hpp>
#include <deferalloc/core/context.hpp>
#include <deferalloc/core/driver.hpp>
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/pinned_pool.hpp>
#include <deferalloc/core/reservations.hpp>
