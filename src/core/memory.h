// Checked size arithmetic and the memory limit (docs/robustness.md, "Limits").
//
// Every size the library computes from user input (element counts, byte counts, workspace sizes)
// goes through the checked operations below: an overflow is an hlm::Error naming the quantity,
// never a wrapped value that allocates too little.
//
// The memory limit is the most memory one command may plan to use: HLM_MEMORY_LIMIT when set
// (bytes, or a number with a K, M, G or T suffix, powers of 1024), else the smaller of the
// physical memory and the cgroup's memory.max. Commands estimate what they need from the shapes
// before allocating (model/config_limits.h) and refuse with a message naming both numbers; a
// single allocation above the limit is refused the same way (core/device.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace hlm {

// a * b and a + b of non-negative values; hlm::Error ("<what> overflows: a * b") on overflow or a
// negative operand.
int64_t checked_mul(int64_t a, int64_t b, const char* what);
int64_t checked_add(int64_t a, int64_t b, const char* what);
uint64_t checked_mul_u(uint64_t a, uint64_t b, const char* what);
uint64_t checked_add_u(uint64_t a, uint64_t b, const char* what);

// The memory limit in bytes (see above; HLM_MEMORY_LIMIT is read at each call, the system's
// memory once per process).
uint64_t memory_limit();
// Parses a HLM_MEMORY_LIMIT value ("17179869184", "16G", "512M"); hlm::Error when malformed.
uint64_t parse_byte_size(const std::string& text, const std::string& what);
// "1.50 GiB" style (B, KiB, MiB, GiB, TiB).
std::string format_bytes(double bytes);
// hlm::Error "<what> needs <bytes> (<format>), more than the memory limit of <limit> (<format>)"
// when bytes > memory_limit().
void check_memory(uint64_t bytes, const std::string& what);

}  // namespace hlm
