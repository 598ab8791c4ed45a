// The C++ API in one include.
#pragma once
#include <deferalloc/chunk_pool.hpp>
#include <deferalloc/config.hpp>
#include <deferalloc/context.hpp>
#include <deferalloc/driver.hpp>
#include <deferalloc/errors.hpp>
#include <deferalloc/pinned_pool.hpp>
#include <deferalloc/reservations.hpp>
