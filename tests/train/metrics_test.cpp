#include "train/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "core/error.h"

namespace hlm::train {
namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string l; std::getline(ss, l);) out.push_back(l);
  return out;
}

MetricsRecord rec(int64_t step, double loss, std::optional<double> acc = std::nullopt) {
  MetricsRecord r;
  r.step = step;
  r.loss = loss;
  r.lr = 1e-3 / double(step);
  r.grad_norm = 0.5 + 0.01 * double(step);
  r.tokens_per_s = 1000.0 * double(step);
  r.eval_accuracy = acc;
  return r;
}

TEST(Metrics, JsonlLinesAreFlushedWithTheFixedKeys) {
  const std::string path = ::testing::TempDir() + "/train_metrics_a.jsonl";
  MetricsWriter w(path);
  MetricsRecord r1 = rec(1, 5.25);
  r1.extra["eval_loss"] = 4.5;
  w.write(r1);
  w.write(rec(2, NAN, 0.125));
  // Read while the writer is still open: every line is already on disk.
  const auto lines = lines_of(slurp(path));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], R"({"step":1,"loss":5.25,"lr":0.001,"grad_norm":0.51,"tokens_per_s":1000.0,)"
                      R"("eval_loss":4.5})");
  auto j = nlohmann::ordered_json::parse(lines[1]);
  std::vector<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
  EXPECT_EQ(keys, (std::vector<std::string>{"step", "loss", "lr", "grad_norm", "tokens_per_s",
                                            "eval_accuracy"}));
  EXPECT_TRUE(j["loss"].is_null());  // NaN: JSON has none
  EXPECT_EQ(j["eval_accuracy"].get<double>(), 0.125);
  EXPECT_EQ(j["lr"].get<double>(), 1e-3 / 2);  // doubles round-trip exactly
  const auto back = read_metrics(path);
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0].step, 1);
  EXPECT_EQ(back[0].grad_norm, 0.51);
  EXPECT_EQ(back[0].extra.at("eval_loss"), 4.5);
  EXPECT_FALSE(back[0].eval_accuracy.has_value());
  EXPECT_TRUE(std::isnan(back[1].loss));
  EXPECT_EQ(*back[1].eval_accuracy, 0.125);
  EXPECT_THROW(metrics_from_json("{\"loss\": 1}", "x"), Error);
  EXPECT_THROW(metrics_from_json("[1, 2]", "x"), Error);
  EXPECT_THROW(metrics_from_json("{\"step\": 1,", "x"), Error);
}

TEST(Metrics, ResumeDropsLinesAfterTheResumeStep) {
  const std::string path = ::testing::TempDir() + "/train_metrics_b.jsonl";
  {
    MetricsWriter w(path);
    for (int64_t s = 1; s <= 10; ++s) w.write(rec(s, 10.0 - double(s), s % 5 == 0 ? 0.1 * s : 0));
  }
  {
    // Resume from the checkpoint at step 6: lines 7..10 are dropped, new lines follow.
    MetricsWriter w(path, 6);
    EXPECT_EQ(w.kept_on_resume(), 6);
    EXPECT_EQ(read_metrics(path).size(), 6u);
    w.write(rec(7, 3.5));
    w.write(rec(8, 3.25));
  }
  auto rs = read_metrics(path);
  ASSERT_EQ(rs.size(), 8u);
  for (size_t i = 0; i < rs.size(); ++i) EXPECT_EQ(rs[i].step, int64_t(i + 1));
  EXPECT_EQ(rs[4].eval_accuracy.value(), 0.5);
  EXPECT_EQ(rs[6].loss, 3.5);
  // A crash mid-write leaves a partial last line: it is skipped when reading and dropped on resume.
  {
    std::ofstream f(path, std::ios::app | std::ios::binary);
    f << R"({"step":9,"loss":3.)";
  }
  EXPECT_EQ(read_metrics(path).size(), 8u);
  {
    MetricsWriter w(path, 100);
    EXPECT_EQ(w.kept_on_resume(), 8);
  }
  EXPECT_EQ(lines_of(slurp(path)).size(), 8u);
  // A malformed line in the middle is an error naming the line.
  {
    std::ofstream f(path, std::ios::app | std::ios::binary);
    f << "garbage\n"
      << R"({"step":9,"loss":1,"lr":1,"grad_norm":1,"tokens_per_s":1})"
      << "\n";
  }
  try {
    read_metrics(path);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 9"), std::string::npos) << e.what();
  }
  // A fresh run truncates.
  { MetricsWriter w(path); }
  EXPECT_EQ(slurp(path), "");
}

TEST(Metrics, ProgressLineAndFormats) {
  EXPECT_EQ(format_duration(12.4), "12s");
  EXPECT_EQ(format_duration(245), "4m05s");
  EXPECT_EQ(format_duration(3723), "1h02m03s");
  EXPECT_EQ(format_duration(NAN), "--");
  EXPECT_EQ(format_rate(999), "999");
  EXPECT_EQ(format_rate(12345), "12.3k");
  EXPECT_EQ(format_rate(4.5678e6), "4.57M");
  EXPECT_EQ(ProgressBar::line(50, 200, 2.5, 12345, 83, true, 10),
            "step  50/200 [##........]  25.0% | loss 2.5000 | 12.3k tok/s | ETA 1m23s");
  EXPECT_EQ(ProgressBar::line(200, 200, 0.123456, 1e6, 0, false),
            "step 200/200 100.0% | loss 0.1235 | 1.00M tok/s | ETA 0s");
  // Plain mode (not a terminal): one line per update, no carriage returns or escapes.
  const std::string path = ::testing::TempDir() + "/train_progress.txt";
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  {
    ProgressBar pb(4, 0, f);  // automatic: a file is not a TTY
    EXPECT_FALSE(pb.is_tty());
    for (int s = 1; s <= 4; ++s) pb.update(s, 1.0 / s, 100);
    pb.finish();
  }
  ProgressBar tty(4, 2, f, ProgressBar::Mode::tty);
  tty.update(3, 0.5, 100);
  tty.update(4, 0.25, 100);
  tty.finish();
  std::fclose(f);
  const std::string out = slurp(path);
  const auto ls = lines_of(out);
  ASSERT_EQ(ls.size(), 5u);
  EXPECT_EQ(ls[0].rfind("step 1/4  25.0% | loss 1.0000 | 100 tok/s | ETA ", 0), 0u) << ls[0];
  EXPECT_EQ(ls[3].find('\r'), std::string::npos);
  EXPECT_EQ(ls[4].rfind("\rstep 3/4 [", 0), 0u);
  EXPECT_NE(ls[4].find("\x1b[K\rstep 4/4 [########################] 100.0%"), std::string::npos);
}

// ---- SVG: a small XML well-formedness check (tags nest, attributes quoted, entities valid) ----

::testing::AssertionResult well_formed_xml(const std::string& s, std::string* root) {
  std::vector<std::string> stack;
  size_t i = 0, roots = 0;
  const std::regex name_re("[A-Za-z_][-A-Za-z0-9_.:]*");
  const std::regex attr_re(R"(\s+[A-Za-z_:][-A-Za-z0-9_.:]*="[^"<]*")");
  auto check_text = [&](const std::string& t) -> bool {
    for (size_t k = t.find('&'); k != std::string::npos; k = t.find('&', k + 1)) {
      const size_t semi = t.find(';', k);
      if (semi == std::string::npos) return false;
      const std::string ent = t.substr(k + 1, semi - k - 1);
      if (ent != "amp" && ent != "lt" && ent != "gt" && ent != "quot" && ent != "apos")
        return false;
    }
    return true;
  };
  if (s.rfind("<?xml", 0) == 0) i = s.find("?>") + 2;
  while (i < s.size()) {
    const size_t lt = s.find('<', i);
    const std::string text = s.substr(i, lt == std::string::npos ? std::string::npos : lt - i);
    if (!check_text(text)) return ::testing::AssertionFailure() << "bad entity in: " << text;
    if (lt == std::string::npos) break;
    if (stack.empty() && text.find_first_not_of(" \n\t") != std::string::npos)
      return ::testing::AssertionFailure() << "text outside the root";
    const size_t gt = s.find('>', lt);
    if (gt == std::string::npos) return ::testing::AssertionFailure() << "unclosed tag";
    std::string tag = s.substr(lt + 1, gt - lt - 1);
    if (!tag.empty() && tag[0] == '/') {
      const std::string n = tag.substr(1);
      if (stack.empty() || stack.back() != n)
        return ::testing::AssertionFailure()
               << "</" << n << "> does not close " << (stack.empty() ? "anything" : stack.back());
      stack.pop_back();
    } else {
      const bool self = !tag.empty() && tag.back() == '/';
      if (self) tag.pop_back();
      std::smatch m;
      if (!std::regex_search(tag, m, name_re) || m.position(0) != 0)
        return ::testing::AssertionFailure() << "bad tag <" << tag << ">";
      const std::string n = m.str(0);
      const std::string rest = std::regex_replace(tag.substr(n.size()), attr_re, "");
      if (rest.find_first_not_of(" \n\t") != std::string::npos)
        return ::testing::AssertionFailure() << "bad attributes in <" << tag << ">: " << rest;
      if (stack.empty()) {
        ++roots;
        if (root) *root = tag;
      }
      if (!self) stack.push_back(n);
    }
    i = gt + 1;
  }
  if (!stack.empty()) return ::testing::AssertionFailure() << "<" << stack.back() << "> not closed";
  if (roots != 1) return ::testing::AssertionFailure() << roots << " root elements";
  return ::testing::AssertionSuccess();
}

std::vector<std::pair<double, double>> polyline_points(const std::string& svg, const char* cls) {
  std::vector<std::pair<double, double>> pts;
  const std::string key = std::string("<polyline class=\"") + cls + "\"";
  const size_t at = svg.find(key);
  if (at == std::string::npos) return pts;
  const size_t p = svg.find("points=\"", at) + 8;
  std::stringstream ss(svg.substr(p, svg.find('"', p) - p));
  for (std::string xy; ss >> xy;) {
    const size_t comma = xy.find(',');
    pts.emplace_back(std::stod(xy.substr(0, comma)), std::stod(xy.substr(comma + 1)));
  }
  return pts;
}

TEST(Metrics, SvgIsWellFormedAndHoldsThePoints) {
  std::vector<MetricsRecord> rs;
  for (int64_t s = 10; s <= 400; s += 10)
    rs.push_back(rec(s, 6.0 * std::exp(-double(s) / 150.0) + 0.5,
                     s % 100 == 0 ? std::optional<double>(double(s) / 500.0) : std::nullopt));
  rs[7].loss = NAN;  // skipped in the plot
  const std::string svg = render_svg(rs, "run <a> & b");
  std::string root;
  ASSERT_TRUE(well_formed_xml(svg, &root)) << svg.substr(0, 2000);
  EXPECT_EQ(root.rfind("svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u) << root;
  EXPECT_NE(svg.find("run &lt;a&gt; &amp; b"), std::string::npos);
  const auto loss = polyline_points(svg, "loss");
  ASSERT_EQ(loss.size(), rs.size() - 1);
  // x is affine in the step, y decreases as the loss grows (SVG y points down).
  std::vector<const MetricsRecord*> finite;
  for (const auto& r : rs)
    if (std::isfinite(r.loss)) finite.push_back(&r);
  const double x0 = loss.front().first, x1 = loss.back().first;
  const double s0 = double(finite.front()->step), s1 = double(finite.back()->step);
  const double y0 = loss.front().second, y1 = loss.back().second;
  const double l0 = finite.front()->loss, l1 = finite.back()->loss;
  for (size_t i = 0; i < loss.size(); ++i) {
    EXPECT_NEAR((loss[i].first - x0) / (x1 - x0), (double(finite[i]->step) - s0) / (s1 - s0), 1e-4);
    EXPECT_NEAR((loss[i].second - y0) / (y1 - y0), (finite[i]->loss - l0) / (l1 - l0), 1e-3);
  }
  EXPECT_GT(loss.back().second, loss.front().second);  // lower loss -> lower on the page
  const auto acc = polyline_points(svg, "accuracy");
  ASSERT_EQ(acc.size(), 4u);  // steps 100, 200, 300, 400
  for (size_t i = 1; i < acc.size(); ++i) {
    EXPECT_LT(acc[i].second, acc[i - 1].second);  // accuracy rises: points go up
    EXPECT_GT(acc[i].first, acc[i - 1].first);
  }
  // Same step scale in both panels.
  EXPECT_NEAR(acc[0].first, loss[8].first, 1e-6);  // step 100 (step 80 has no loss)
  // Without eval points there is no accuracy panel; an empty run is still a valid document.
  rs.assign(rs.begin(), rs.begin() + 3);
  for (auto& r : rs) r.eval_accuracy.reset();
  const std::string one = render_svg(rs);
  EXPECT_TRUE(well_formed_xml(one, nullptr));
  EXPECT_EQ(one.find("class=\"accuracy\""), std::string::npos);
  EXPECT_TRUE(well_formed_xml(render_svg({}), nullptr));
  // The SVG backend writes base.svg.
  const std::string base = ::testing::TempDir() + "/train_plot_svg";
  EXPECT_EQ(write_plot(rs, base, PlotBackend::svg), base + ".svg");
  EXPECT_EQ(slurp(base + ".svg"), one);
}

TEST(Metrics, GnuplotWritesAPng) {
  if (find_on_path("gnuplot").empty()) GTEST_SKIP() << "gnuplot is not on PATH";
  std::vector<MetricsRecord> rs;
  for (int64_t s = 1; s <= 20; ++s)
    rs.push_back(rec(s, 3.0 / double(s), s % 5 == 0 ? 0.04 * s : 0));
  const std::string base = ::testing::TempDir() + "/train_plot_png";
  std::filesystem::remove(base + ".png");
  EXPECT_EQ(write_plot(rs, base, PlotBackend::gnuplot, "test run"), base + ".png");
  const std::string png = slurp(base + ".png");
  ASSERT_GT(png.size(), 8u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_FALSE(std::filesystem::exists(base + ".png.gp.tmp"));
  EXPECT_EQ(write_plot(rs, base), base + ".png");  // automatic picks gnuplot
}

TEST(Metrics, FindOnPath) {
  EXPECT_FALSE(find_on_path("sh").empty());
  EXPECT_TRUE(find_on_path("surely-not-a-program-hlm").empty());
}

}  // namespace
}  // namespace hlm::train
