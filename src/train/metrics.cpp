// metrics.jsonl, the progress line and the end-of-run plot (see metrics.h).
#include "train/metrics.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/file_io.h"

extern char** environ;

namespace hlm::train {
namespace {

using ojson = nlohmann::ordered_json;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double number_or_nan(const ojson& j, const char* key, const std::string& what) {
  auto it = j.find(key);
  HLM_CHECK(it != j.end(), "{}: missing \"{}\"", what, key);
  if (it->is_null()) return NAN;
  HLM_CHECK(it->is_number(), "{}: \"{}\" must be a number or null", what, key);
  return it->get<double>();
}

struct Line {
  MetricsRecord record;
  std::string text;
};

std::vector<Line> read_lines(const std::string& path) {
  std::vector<Line> out;
  if (file_kind(path) == "missing") return out;
  const std::vector<uint8_t> bytes = read_regular_file(path, "metrics file");  // never a FIFO
  const std::string s(bytes.begin(), bytes.end());
  size_t pos = 0;
  int64_t line_no = 0;
  while (pos < s.size()) {
    const size_t nl = s.find('\n', pos);
    const bool complete = nl != std::string::npos;
    const std::string text = s.substr(pos, complete ? nl - pos : std::string::npos);
    pos = complete ? nl + 1 : s.size();
    ++line_no;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string what = fmt::format("metrics file '{}' line {}", path, line_no);
    try {
      out.push_back({metrics_from_json(text, what), text});
    } catch (const Error&) {
      if (complete) throw;  // a partial last line is what a crash mid-write leaves: skip it
    }
  }
  return out;
}

// Writes `text` to path atomically (temporary file, flush, fsync, rename).
// Atomically, through the resolved target (core/file_io.h: a symlink is written through, a
// device, FIFO or directory is never replaced).
void write_file_atomic(const std::string& path, const std::string& text) {
  write_file_replacing(resolve_output_path(path, "metrics file"),
                       std::vector<uint8_t>(text.begin(), text.end()), "metrics file");
}

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      case '\'':
        o += "&apos;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

// Axis range with "nice" tick spacing (1, 2 or 5 times a power of ten).
struct Axis {
  double lo, hi, tick;
};
Axis nice_axis(double lo, double hi, int target_ticks = 5) {
  if (!(hi > lo)) {
    const double pad = lo != 0 ? std::fabs(lo) * 0.1 : 1.0;
    lo -= pad, hi += pad;
  }
  const double raw = (hi - lo) / target_ticks;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  const double tick = (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
  return {lo, hi, tick};
}

std::string tick_label(double v, double tick) {
  if (std::fabs(v) < tick * 1e-9) v = 0;
  return fmt::format("{:g}", v);
}

struct Series {
  std::vector<double> x, y;
};

// One panel: frame, grid ticks, labels and the series as a polyline (and dots when asked).
void svg_panel(std::string& o, double left, double top, double w, double h, const Axis& xa,
               const Axis& ya, const Series& s, const char* cls, const char* color,
               const char* ylabel, bool dots) {
  auto X = [&](double x) { return left + (x - xa.lo) / (xa.hi - xa.lo) * w; };
  auto Y = [&](double y) { return top + (1.0 - (y - ya.lo) / (ya.hi - ya.lo)) * h; };
  o += fmt::format(
      "<rect x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" fill=\"none\" "
      "stroke=\"#444444\"/>\n",
      left, top, w, h);
  for (double t = std::ceil(xa.lo / xa.tick) * xa.tick; t <= xa.hi + xa.tick * 1e-9; t += xa.tick) {
    const double x = X(t);
    o += fmt::format(
        "<line x1=\"{:.2f}\" y1=\"{:.2f}\" x2=\"{:.2f}\" y2=\"{:.2f}\" stroke=\"#dddddd\"/>\n", x,
        top, x, top + h);
    o += fmt::format(
        "<text x=\"{:.2f}\" y=\"{:.2f}\" font-size=\"11\" text-anchor=\"middle\">{}</text>\n", x,
        top + h + 15, xml_escape(tick_label(t, xa.tick)));
  }
  for (double t = std::ceil(ya.lo / ya.tick) * ya.tick; t <= ya.hi + ya.tick * 1e-9; t += ya.tick) {
    const double y = Y(t);
    o += fmt::format(
        "<line x1=\"{:.2f}\" y1=\"{:.2f}\" x2=\"{:.2f}\" y2=\"{:.2f}\" stroke=\"#dddddd\"/>\n",
        left, y, left + w, y);
    o += fmt::format(
        "<text x=\"{:.2f}\" y=\"{:.2f}\" font-size=\"11\" text-anchor=\"end\">{}</text>\n",
        left - 6, y + 4, xml_escape(tick_label(t, ya.tick)));
  }
  o += fmt::format(
      "<text x=\"{:.2f}\" y=\"{:.2f}\" font-size=\"12\" text-anchor=\"middle\" "
      "transform=\"rotate(-90 {:.2f} {:.2f})\">{}</text>\n",
      left - 48, top + h / 2, left - 48, top + h / 2, ylabel);
  o += fmt::format(
      "<text x=\"{:.2f}\" y=\"{:.2f}\" font-size=\"12\" text-anchor=\"middle\">step</text>\n",
      left + w / 2, top + h + 32);
  std::string pts;
  for (size_t i = 0; i < s.x.size(); ++i)
    pts += fmt::format("{}{:.2f},{:.2f}", i ? " " : "", X(s.x[i]), Y(s.y[i]));
  o += fmt::format(
      "<polyline class=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n",
      cls, color, pts);
  if (dots || s.x.size() == 1)
    for (size_t i = 0; i < s.x.size(); ++i)
      o += fmt::format("<circle cx=\"{:.2f}\" cy=\"{:.2f}\" r=\"2.5\" fill=\"{}\"/>\n", X(s.x[i]),
                       Y(s.y[i]), color);
}

// Runs `argv` with stdout and stderr to `log`; returns the exit status (-1: did not run).
int run_program(const std::vector<std::string>& argv, const std::string& log) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  const int rc = posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return -1;
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// gnuplot: returns an empty string on success, else why it failed.
std::string plot_gnuplot(const std::vector<MetricsRecord>& records, const std::string& png,
                         const std::string& title) {
  if (png.find('\'') != std::string::npos || title.find('\'') != std::string::npos)
    return "the path or title contains a single quote";
  const std::string dat = png + ".dat.tmp", gp = png + ".gp.tmp", log = png + ".log.tmp";
  bool any_acc = false;
  {
    std::ofstream d(dat);
    d << "# step loss eval_accuracy\n";
    for (const auto& r : records) {
      d << r.step << ' ';
      if (std::isfinite(r.loss))
        d << fmt::format("{:.17g}", r.loss);
      else
        d << '?';
      d << ' ';
      if (r.eval_accuracy && std::isfinite(*r.eval_accuracy)) {
        d << fmt::format("{:.17g}", *r.eval_accuracy);
        any_acc = true;
      } else {
        d << '?';
      }
      d << '\n';
    }
  }
  int64_t lo = 0, hi = 0;  // the same step range in both panels
  for (size_t i = 0; i < records.size(); ++i) {
    lo = i ? std::min(lo, records[i].step) : records[i].step;
    hi = i ? std::max(hi, records[i].step) : records[i].step;
  }
  std::string why;
  for (const char* term : {"pngcairo size 1000,800 noenhanced", "png size 1000,800 noenhanced"}) {
    std::ofstream s(gp);
    s << "set terminal " << term << "\n";
    s << "set output '" << png << "'\n";
    s << "set datafile missing '?'\nset grid\nset key top right\n";
    if (!records.empty() && lo < hi) s << "set xrange [" << lo << ":" << hi << "]\n";
    if (any_acc)
      s << "set multiplot layout 2,1 title '" << title << "'\n";
    else if (!title.empty())
      s << "set title '" << title << "'\n";
    s << "set xlabel 'step'\nset ylabel 'loss'\n";
    s << "plot '" << dat << "' using 1:2 with lines lw 1.5 title 'loss'\n";
    if (any_acc) {
      s << "set ylabel 'eval accuracy'\nset yrange [0:1]\n";
      s << "plot '" << dat << "' using 1:3 with linespoints pt 7 ps 0.6 title 'eval accuracy'\n";
      s << "unset multiplot\n";
    }
    s.close();
    std::remove(png.c_str());
    const int rc = run_program({"gnuplot", gp}, log);
    std::error_code ec;
    if (rc == 0 && std::filesystem::exists(png, ec) && std::filesystem::file_size(png, ec) > 0) {
      why.clear();
      break;
    }
    why = fmt::format("gnuplot exited with {}: {}", rc, read_text(log));
  }
  std::remove(dat.c_str());
  std::remove(gp.c_str());
  std::remove(log.c_str());
  return why;
}

}  // namespace

// ---- metrics.jsonl ---------------------------------------------------------------------------

std::string metrics_to_json(const MetricsRecord& r) {
  ojson j;
  j["step"] = r.step;
  j["loss"] = r.loss;  // nlohmann writes NaN / Inf as null
  j["lr"] = r.lr;
  j["grad_norm"] = r.grad_norm;
  j["tokens_per_s"] = r.tokens_per_s;
  if (r.eval_accuracy) j["eval_accuracy"] = *r.eval_accuracy;
  for (const auto& [k, v] : r.extra) {
    HLM_CHECK(!j.contains(k), "metrics: extra key '{}' collides with a fixed key", k);
    j[k] = v;
  }
  return j.dump();
}

MetricsRecord metrics_from_json(const std::string& line, const std::string& what) {
  ojson j;
  try {
    j = ojson::parse(line);
  } catch (const std::exception& e) {
    HLM_FAIL("{}: not valid JSON ({})", what, e.what());
  }
  HLM_CHECK(j.is_object(), "{}: expected a JSON object", what);
  MetricsRecord r;
  auto st = j.find("step");
  HLM_CHECK(st != j.end() && st->is_number_integer(), "{}: \"step\" must be an integer", what);
  r.step = st->get<int64_t>();
  r.loss = number_or_nan(j, "loss", what);
  r.lr = number_or_nan(j, "lr", what);
  r.grad_norm = number_or_nan(j, "grad_norm", what);
  r.tokens_per_s = number_or_nan(j, "tokens_per_s", what);
  if (j.contains("eval_accuracy")) r.eval_accuracy = number_or_nan(j, "eval_accuracy", what);
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    if (k == "step" || k == "loss" || k == "lr" || k == "grad_norm" || k == "tokens_per_s" ||
        k == "eval_accuracy")
      continue;
    if (it->is_number())
      r.extra[k] = it->get<double>();
    else if (it->is_null())
      r.extra[k] = NAN;
  }
  return r;
}

std::vector<MetricsRecord> read_metrics(const std::string& path) {
  std::vector<MetricsRecord> out;
  for (auto& l : read_lines(path)) out.push_back(std::move(l.record));
  return out;
}

MetricsWriter::MetricsWriter(const std::string& path, std::optional<int64_t> resume_step)
    : path_(path) {
  std::string kept_text;
  if (resume_step) {
    for (const Line& l : read_lines(path))
      if (l.record.step <= *resume_step) kept_text += l.text + "\n", ++kept_;
  }
  write_file_atomic(path, kept_text);
  f_ = std::fopen(path.c_str(), "ab");
  HLM_CHECK(f_ != nullptr, "cannot open metrics file '{}' for appending", path);
}

MetricsWriter::~MetricsWriter() {
  if (f_) std::fclose(f_);
}

void MetricsWriter::write(const MetricsRecord& r) {
  const std::string line = metrics_to_json(r) + "\n";
  HLM_CHECK(std::fwrite(line.data(), 1, line.size(), f_) == line.size() && std::fflush(f_) == 0,
            "cannot write to metrics file '{}'", path_);
}

// ---- progress --------------------------------------------------------------------------------

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--";
  if (seconds >= 3.6e9) return fmt::format("{:.3g}h", seconds / 3600.0);  // llround's range
  const int64_t s = std::llround(seconds);
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m{:02}s", s / 3600, (s / 60) % 60, s % 60);
}

std::string format_rate(double r) {
  if (!std::isfinite(r) || r < 0) return "--";
  if (r < 1e3) return fmt::format("{:.0f}", r);
  if (r < 1e6) return fmt::format("{:.1f}k", r / 1e3);
  if (r < 1e9) return fmt::format("{:.2f}M", r / 1e6);
  return fmt::format("{:.2f}G", r / 1e9);
}

ProgressBar::ProgressBar(int64_t total_steps, int64_t start_step, std::FILE* out, Mode mode)
    : total_(total_steps), start_(start_step), out_(out), t0_(now_seconds()) {
  HLM_CHECK(total_steps >= 1, "progress: total_steps must be >= 1, got {}", total_steps);
  HLM_CHECK(out != nullptr, "progress: no output stream");
  tty_ = mode == Mode::tty || (mode == Mode::automatic && ::isatty(::fileno(out)));
}

std::string ProgressBar::line(int64_t step, int64_t total, double loss, double tokens_per_s,
                              double eta_s, bool with_bar, int bar_width) {
  const double frac = total > 0 ? std::clamp(double(step) / double(total), 0.0, 1.0) : 0.0;
  std::string bar;
  if (with_bar) {
    const int filled = int(std::floor(frac * bar_width));
    bar = " [" + std::string(size_t(filled), '#') + std::string(size_t(bar_width - filled), '.') +
          "]";
  }
  const int w = int(std::to_string(total).size());
  return fmt::format("step {:>{}}/{}{} {:5.1f}% | loss {:.4f} | {} tok/s | ETA {}", step, w, total,
                     bar, 100.0 * frac, loss, format_rate(tokens_per_s), format_duration(eta_s));
}

void ProgressBar::update(int64_t step, double loss, double tokens_per_s) {
  const double elapsed = now_seconds() - t0_;
  const int64_t done = step - start_;
  const double eta = done > 0 && elapsed > 0 ? elapsed / double(done) * double(total_ - step) : NAN;
  const std::string l = line(step, total_, loss, tokens_per_s, eta, tty_);
  if (tty_) {
    std::fprintf(out_, "\r%s\x1b[K", l.c_str());
    open_line_ = true;
  } else {
    std::fprintf(out_, "%s\n", l.c_str());
  }
  std::fflush(out_);
}

void ProgressBar::finish() {
  if (tty_ && open_line_) std::fputc('\n', out_);
  open_line_ = false;
  std::fflush(out_);
}

// ---- plot ------------------------------------------------------------------------------------

std::string render_svg(const std::vector<MetricsRecord>& records, const std::string& title) {
  std::vector<MetricsRecord> rs = records;
  std::stable_sort(rs.begin(), rs.end(),
                   [](const MetricsRecord& a, const MetricsRecord& b) { return a.step < b.step; });
  Series loss, acc;
  for (const auto& r : rs) {
    if (std::isfinite(r.loss)) loss.x.push_back(double(r.step)), loss.y.push_back(r.loss);
    if (r.eval_accuracy && std::isfinite(*r.eval_accuracy))
      acc.x.push_back(double(r.step)), acc.y.push_back(*r.eval_accuracy);
  }
  double xlo = 0, xhi = 1;
  if (!rs.empty()) xlo = double(rs.front().step), xhi = double(rs.back().step);
  const Axis xa = nice_axis(xlo, xhi);
  double ylo = 0, yhi = 1;
  if (!loss.y.empty()) {
    ylo = *std::min_element(loss.y.begin(), loss.y.end());
    yhi = *std::max_element(loss.y.begin(), loss.y.end());
    const double pad = (yhi - ylo) * 0.05;
    ylo -= pad, yhi += pad;
  }
  const Axis ya = nice_axis(ylo, yhi);
  const bool with_acc = !acc.x.empty();
  const double W = 800, left = 80, right = 20, top0 = 40, ph = 240, gap = 60;
  const double H = top0 + ph + (with_acc ? gap + ph : 0) + 50;
  std::string o;
  o += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  o += fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" "
      "viewBox=\"0 0 {:.0f} {:.0f}\" font-family=\"sans-serif\">\n",
      W, H, W, H);
  o += "<rect x=\"0\" y=\"0\" width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o +=
      fmt::format("<text x=\"{:.0f}\" y=\"24\" font-size=\"15\" text-anchor=\"middle\">{}</text>\n",
                  W / 2, xml_escape(title.empty() ? std::string("training metrics") : title));
  svg_panel(o, left, top0, W - left - right, ph, xa, ya, loss, "loss", "#1f77b4", "loss", false);
  if (with_acc)
    svg_panel(o, left, top0 + ph + gap, W - left - right, ph, xa, Axis{0, 1, 0.2}, acc, "accuracy",
              "#d62728", "eval accuracy", true);
  o += "</svg>\n";
  return o;
}

std::string find_on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  if (!path || program.empty()) return "";
  std::string p(path);
  size_t pos = 0;
  while (pos <= p.size()) {
    size_t colon = p.find(':', pos);
    if (colon == std::string::npos) colon = p.size();
    std::string dir = p.substr(pos, colon - pos);
    if (dir.empty()) dir = ".";
    const std::string full = dir + "/" + program;
    struct stat st;
    if (::stat(full.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(full.c_str(), X_OK) == 0)
      return full;
    pos = colon + 1;
  }
  return "";
}

std::string write_plot(const std::vector<MetricsRecord>& records, const std::string& base,
                       PlotBackend backend, const std::string& title) {
  if (backend != PlotBackend::svg) {
    const bool have = !find_on_path("gnuplot").empty();
    HLM_CHECK(have || backend == PlotBackend::automatic, "plot: gnuplot is not on PATH");
    if (have) {
      const std::string png = base + ".png";
      const std::string why = plot_gnuplot(records, png, title);
      if (why.empty()) return png;
      HLM_CHECK(backend == PlotBackend::automatic, "plot: {}", why);
    }
  }
  const std::string svg = base + ".svg";
  write_file_atomic(svg, render_svg(records, title));
  return svg;
}

}  // namespace hlm::train
