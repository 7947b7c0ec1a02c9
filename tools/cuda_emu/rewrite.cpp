// cuda_emu_rewrite IN.cu OUT.cpp: turns a CUDA source into C++ that g++ compiles against
// cuda_emu.h, for the CPU emulation build (HLM_CUDA_EMU). Two constructs of CUDA C++ are not
// C++ and are rewritten; everything else is left as it is, on the same lines:
//   NAME<<<grid, block[, smem[, stream]]>>>(args);
//     -> ::hlm::emu::launch(::hlm::emu::LaunchConfig(grid, block[, smem[, stream]]),
//                           [&]() { NAME(args); });
//     (every emulated thread calls the kernel, so template arguments are deduced from args as
//     nvcc deduces them);
//   extern __shared__ TYPE NAME[];
//     -> TYPE* NAME = reinterpret_cast<TYPE*>(::hlm::emu::dynamic_smem());
// Comments, string and character literals are copied untouched and never rewritten. The output
// starts with #include "cuda_emu.h" and a #line directive naming IN, so diagnostics and debug
// information point at the original file and line.
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace {

[[noreturn]] void fail(const std::string& file, const std::string& src, size_t at,
                       const std::string& what) {
  int line = 1;
  for (size_t i = 0; i < at && i < src.size(); ++i) line += src[i] == '\n';
  std::fprintf(stderr, "%s:%d: cuda_emu_rewrite: %s\n", file.c_str(), line, what.c_str());
  std::exit(1);
}

// Marks every character of src that belongs to a comment or a literal (1) or to code (0).
std::string code_mask(const std::string& s) {
  std::string m(s.size(), 0);
  size_t i = 0;
  while (i < s.size()) {
    if (s.compare(i, 2, "//") == 0) {
      while (i < s.size() && s[i] != '\n') m[i++] = 1;
    } else if (s.compare(i, 2, "/*") == 0) {
      const size_t e = s.find("*/", i + 2);
      const size_t end = e == std::string::npos ? s.size() : e + 2;
      while (i < end) m[i++] = 1;
    } else if (s[i] == '"' || s[i] == '\'') {
      // A raw string R"d(...)d" is not used in the CUDA sources; a quote inside a number
      // separator (1'000) would be: digits before ' mark a separator.
      if (s[i] == '\'' && i > 0 && std::isxdigit(static_cast<unsigned char>(s[i - 1]))) {
        ++i;
        continue;
      }
      const char q = s[i];
      m[i++] = 1;
      while (i < s.size() && s[i] != q) {
        if (s[i] == '\\') m[i++] = 1;
        if (i < s.size()) m[i++] = 1;
      }
      if (i < s.size()) m[i++] = 1;
    } else {
      ++i;
    }
  }
  return m;
}

bool ident_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: cuda_emu_rewrite IN.cu OUT.cpp\n");
    return 2;
  }
  const std::string in = argv[1], out = argv[2];
  std::ifstream f(in, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "cuda_emu_rewrite: cannot read %s\n", in.c_str());
    return 1;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();

  // extern __shared__ TYPE NAME[];  (the only form of dynamic shared memory the sources use)
  for (;;) {
    const std::string m = code_mask(s);
    size_t at = std::string::npos;
    for (size_t p = s.find("extern __shared__"); p != std::string::npos;
         p = s.find("extern __shared__", p + 1))
      if (!m[p]) {
        at = p;
        break;
      }
    if (at == std::string::npos) break;
    const size_t semi = s.find(';', at);
    const size_t br = s.find("[]", at);
    if (semi == std::string::npos || br == std::string::npos || br > semi)
      fail(in, s, at, "expected 'extern __shared__ TYPE NAME[];'");
    size_t ne = br;
    while (ne > at && std::isspace(static_cast<unsigned char>(s[ne - 1]))) --ne;
    size_t nb = ne;
    while (nb > at && ident_char(s[nb - 1])) --nb;
    const std::string name = s.substr(nb, ne - nb);
    const size_t tb = at + std::string("extern __shared__").size();
    std::string type = s.substr(tb, nb - tb);
    while (!type.empty() && std::isspace(static_cast<unsigned char>(type.back()))) type.pop_back();
    while (!type.empty() && std::isspace(static_cast<unsigned char>(type.front())))
      type.erase(0, 1);
    if (name.empty() || type.empty()) fail(in, s, at, "cannot parse the extern __shared__ array");
    s.replace(
        at, semi + 1 - at,
        type + "* " + name + " = reinterpret_cast<" + type + "*>(::hlm::emu::dynamic_smem());");
  }

  // NAME<<<cfg>>>(args)
  for (;;) {
    const std::string m = code_mask(s);
    size_t lt = std::string::npos;
    for (size_t p = s.find("<<<"); p != std::string::npos; p = s.find("<<<", p + 1))
      if (!m[p]) {
        lt = p;
        break;
      }
    if (lt == std::string::npos) break;
    // The kernel name before <<<: an identifier (with ::), optionally a template argument list.
    size_t b = lt;
    while (b > 0 && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
    if (b > 0 && s[b - 1] == '>') {
      int depth = 0;
      size_t p = b;
      do {
        --p;
        if (!m[p]) {
          if (s[p] == '>') ++depth;
          if (s[p] == '<') --depth;
        }
      } while (p > 0 && depth > 0);
      if (depth != 0) fail(in, s, lt, "unbalanced template arguments before <<<");
      b = p;
    }
    while (b > 0 && (ident_char(s[b - 1]) || s[b - 1] == ':')) --b;
    const size_t gt = s.find(">>>", lt);
    if (gt == std::string::npos) fail(in, s, lt, "<<< without >>>");
    size_t a = gt + 3;
    while (a < s.size() && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
    if (a >= s.size() || s[a] != '(') fail(in, s, gt, "expected the kernel's arguments after >>>");
    int depth = 0;
    size_t e = a;
    for (; e < s.size(); ++e) {
      if (m[e]) continue;
      if (s[e] == '(') ++depth;
      if (s[e] == ')' && --depth == 0) break;
    }
    if (e >= s.size()) fail(in, s, a, "unbalanced parentheses in the kernel's arguments");
    const std::string name = s.substr(b, lt - b);
    // The name as a literal: whitespace runs (a name split over lines) as one space.
    std::string label;
    for (char c : name) {
      if (std::isspace(static_cast<unsigned char>(c))) {
        if (!label.empty() && label.back() != ' ') label += ' ';
      } else if (c == '"' || c == '\\') {
        label += '?';
      } else {
        label += c;
      }
    }
    while (!label.empty() && label.back() == ' ') label.pop_back();
    const std::string cfg = s.substr(lt + 3, gt - lt - 3);
    const std::string args = s.substr(a, e + 1 - a);
    s.replace(b, e + 1 - b,
              "::hlm::emu::launch(\"" + label + "\", ::hlm::emu::LaunchConfig(" + cfg +
                  "), [&]() { " + name + args + "; })");
  }

  const std::filesystem::path dir = std::filesystem::path(out).parent_path();
  if (!dir.empty()) std::filesystem::create_directories(dir);
  std::ofstream o(out, std::ios::binary);
  o << "#include \"cuda_emu.h\"\n#line 1 \"" << in << "\"\n" << s;
  if (!o) {
    std::fprintf(stderr, "cuda_emu_rewrite: cannot write %s\n", out.c_str());
    return 1;
  }
  return 0;
}
