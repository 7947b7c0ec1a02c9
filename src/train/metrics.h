// Training metrics: metrics.jsonl (one JSON object per logged step), a terminal progress line, and
// the end-of-run plot (PNG through gnuplot when it is on PATH, else an SVG written here).
//
// metrics.jsonl: one object per line, keys in this order:
//   {"step": 10, "loss": 2.31, "lr": 0.0003, "grad_norm": 0.87, "tokens_per_s": 51234.5,
//    "eval_accuracy": 0.42, ...extra}
// step is the number of optimizer updates done (1-based); eval_accuracy only on steps that were
// evaluated; extra keys (e.g. "eval_loss") follow. Non-finite numbers are written as null (JSON has
// no NaN) and read back as NaN. Each line is flushed when written.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace hlm::train {

struct MetricsRecord {
  int64_t step = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double tokens_per_s = 0;
  std::optional<double> eval_accuracy;
  std::map<std::string, double> extra;  // written after the fixed keys, in name order
};

std::string metrics_to_json(const MetricsRecord& r);  // one line, no newline
// Parses one line; hlm::Error naming `what` when it is not an object with the fixed keys.
MetricsRecord metrics_from_json(const std::string& line, const std::string& what);
// Every record of a metrics file (a missing file gives none). A last line without its newline that
// does not parse (a crash mid-write) is skipped; any other bad line is an error naming its number.
std::vector<MetricsRecord> read_metrics(const std::string& path);

class MetricsWriter {
 public:
  // Fresh run (resume_step empty): the file is created or truncated. Resumed run: the lines with
  // step <= *resume_step are kept, later ones (logged after the checkpoint) are dropped (the file
  // is rewritten through a temporary file and a rename), and new lines are appended.
  MetricsWriter(const std::string& path, std::optional<int64_t> resume_step = std::nullopt);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void write(const MetricsRecord& r);  // appends one line and flushes
  const std::string& path() const { return path_; }
  int64_t kept_on_resume() const { return kept_; }  // lines kept from the previous run

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
  int64_t kept_ = 0;
};

// ---- progress --------------------------------------------------------------------------------
// "1h02m03s", "4m05s", "12s"; "--" when not finite or negative.
std::string format_duration(double seconds);
// 999, 12.3k, 4.56M, 7.89G.
std::string format_rate(double per_second);

class ProgressBar {
 public:
  enum class Mode { automatic, tty, plain };  // automatic: tty when `out` is a terminal

  // Steps are 1-based update counts; start_step is where this process began (resume step).
  ProgressBar(int64_t total_steps, int64_t start_step = 0, std::FILE* out = stdout,
              Mode mode = Mode::automatic);
  // Reports that `step` updates are done. tty: rewrites one line in place (\r, erase to end of
  // line); plain: prints one line per call.
  void update(int64_t step, double loss, double tokens_per_s);
  void finish();  // tty: ends the line
  bool is_tty() const { return tty_; }

  // The text of one progress line (no \r or newline); eta_s < 0 or NaN prints "--".
  static std::string line(int64_t step, int64_t total, double loss, double tokens_per_s,
                          double eta_s, bool with_bar, int bar_width = 24);

 private:
  int64_t total_, start_;
  std::FILE* out_;
  bool tty_;
  double t0_;  // seconds (steady clock) at construction
  bool open_line_ = false;
};

// ---- plot ------------------------------------------------------------------------------------
enum class PlotBackend { automatic, gnuplot, svg };

// An SVG document: loss vs step (top panel) and, when any record has eval_accuracy, eval accuracy
// vs step (bottom panel). Each series is one <polyline class="loss"> / <polyline class="accuracy">
// with one point per finite value, in step order, plus axes, ticks and labels.
std::string render_svg(const std::vector<MetricsRecord>& records, const std::string& title = "");

// Writes `base`.png through gnuplot (automatic: when gnuplot is on PATH and succeeds) or
// `base`.svg; returns the path written. gnuplot explicitly requested and failing is an error.
std::string write_plot(const std::vector<MetricsRecord>& records, const std::string& base,
                       PlotBackend backend = PlotBackend::automatic, const std::string& title = "");

// The full path of an executable found on PATH, or empty.
std::string find_on_path(const std::string& program);

}  // namespace hlm::train
