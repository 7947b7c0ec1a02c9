// EnumNames: the names of an enum's values as one table, so that a name function and its parse
// function read the same list. For enums with the default numbering 0, 1, ..., last:
//
//   constexpr auto kRecomputeNames = enum_names<Recompute::full>({"none", "selective", "full"});
//   kRecomputeNames.name(Recompute::selective)   // "selective"
//   kRecomputeNames.parse("full", "recompute")   // Recompute::full
//   kRecomputeNames.parse("fll", "recompute")    // hlm::Error: unknown recompute 'fll':
//                                                //   expected one of none, selective, full
//
// enum_names<Last>(...) fails to compile unless it is given exactly one name per value up to
// Last (name the last enumerator, so that adding a value without its name does not compile).
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

namespace hlm {

namespace detail {
// "unknown <what> '<s>': expected one of a, b, c" (hlm::Error).
[[noreturn]] void enum_parse_fail(std::string_view what, std::string_view s,
                                  const char* const* names, size_t n);
}  // namespace detail

template <class E, size_t N>
class EnumNames {
  static_assert(std::is_enum_v<E>);

 public:
  constexpr explicit EnumNames(const std::array<const char*, N>& names) : names_(names) {}

  // The name of `e`; "?" for a value outside the enum (a cast from an unchecked integer).
  constexpr const char* name(E e) const {
    const auto i = size_t(e);
    return i < N ? names_[i] : "?";
  }
  // The value named exactly `s`, or nullopt.
  constexpr std::optional<E> find(std::string_view s) const {
    for (size_t i = 0; i < N; ++i)
      if (s == names_[i]) return E(i);
    return std::nullopt;
  }
  // The value named exactly `s`; otherwise an hlm::Error naming `what` and listing the names.
  E parse(std::string_view s, std::string_view what) const {
    if (const auto e = find(s)) return *e;
    detail::enum_parse_fail(what, s, names_.data(), N);
  }
  constexpr const std::array<const char*, N>& names() const { return names_; }

 private:
  std::array<const char*, N> names_;
};

template <auto Last, size_t N>
constexpr EnumNames<decltype(Last), N> enum_names(const char* const (&names)[N]) {
  static_assert(std::is_enum_v<decltype(Last)>, "enum_names<Last>: Last is the last enumerator");
  static_assert(N == size_t(Last) + 1, "enum_names<Last>: one name per enumerator, in order");
  std::array<const char*, N> a{};
  for (size_t i = 0; i < N; ++i) a[i] = names[i];
  return EnumNames<decltype(Last), N>(a);
}

}  // namespace hlm
