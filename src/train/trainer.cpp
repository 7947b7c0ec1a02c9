// The training loop (trainer.h; docs/training.md, "The training loop").
#include "train/trainer.h"

#include "core/device.h"
#include "dist/context_parallel.h"
#include "dist/nccl_comm.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <set>

#include "core/error.h"
#include "core/json.h"
#include "core/profile.h"
#include "model/checkpoint.h"
#include "ops/cross_entropy.h"
#include "tokenizer/tokenizer.h"
#include "train/interrupt.h"
#include "train/train_limits.h"

namespace hlm::train {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

// A relative path: against base_dir when the file exists there, else as given (current directory).
std::string resolve_path(const std::string& p, const std::string& base_dir) {
  if (p.empty() || fs::path(p).is_absolute() || base_dir.empty()) return p;
  const fs::path in_base = fs::path(base_dir) / p;
  std::error_code ec;
  if (fs::exists(in_base, ec)) return in_base.lexically_normal().string();
  return p;
}

// Keys of two flat JSON objects whose values differ ("key: a -> b").
std::vector<std::string> json_differences(const json& a, const json& b,
                                          const std::set<std::string>& skip = {}) {
  std::vector<std::string> out;
  std::set<std::string> keys;
  for (auto it = a.begin(); it != a.end(); ++it) keys.insert(it.key());
  for (auto it = b.begin(); it != b.end(); ++it) keys.insert(it.key());
  for (const auto& k : keys) {
    if (skip.count(k)) continue;
    const json va = a.contains(k) ? a[k] : json(), vb = b.contains(k) ? b[k] : json();
    if (va != vb) out.push_back(fmt::format("{}: {} -> {}", k, va.dump(), vb.dump()));
  }
  return out;
}

std::string path_in(const std::string& dir, const char* name) {
  return (fs::path(dir) / name).string();
}

// Leftover temporaries of an interrupted save (".<file>.tmp.<pid>.<n>", model/checkpoint.cpp).
void remove_stale_temporaries(const std::string& dir) {
  static const char* kOwned[] = {kTrainerStateFile, checkpoint::kSingleFile,
                                 checkpoint::kConfigFile, kTrainConfigFile};
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    for (const char* f : kOwned)
      if (name.rfind(std::string(".") + f + ".tmp.", 0) == 0) fs::remove(e.path(), ec);
  }
}

// Which term of the objective is not finite, with the values of all of them.
std::string nonfinite_loss_message(const ModelOutput& o) {
  const std::pair<const char*, double> terms[] = {{"main cross-entropy", o.lm_loss},
                                                  {"MTP loss", o.mtp_loss},
                                                  {"MoE aux loss", o.aux_loss},
                                                  {"DSA indexer loss", o.indexer_loss}};
  std::vector<std::string> bad;
  for (const auto& [name, v] : terms)
    if (!std::isfinite(v)) bad.push_back(fmt::format("the {} is {}", name, v));
  return fmt::format("the loss is not finite ({}: {}; main {}, mtp {}, aux {}, indexer {})", o.loss,
                     bad.empty() ? "the sum of finite terms overflowed" : join(bad), o.lm_loss,
                     o.mtp_loss, o.aux_loss, o.indexer_loss);
}

// The gradient norm is not finite: name the first parameter whose gradient holds NaN / Inf.
std::string nonfinite_gradient_message(HybridModel& model, double norm) {
  for (auto& [name, p] : model.named_parameters()) {
    const int64_t i = checkpoint::first_non_finite(p->grad);
    if (i >= 0)
      return fmt::format(
          "the gradient norm is not finite ({}): the gradient of '{}' is not finite at flat "
          "index {}",
          norm, name, i);
  }
  return fmt::format("the gradient norm is not finite ({}: the sum of squares overflowed)", norm);
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  const Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

int64_t parse_meta_int(const safetensors::Metadata& m, const std::string& key,
                       const std::string& what) {
  auto it = m.find(key);
  if (it == m.end()) throw Error(fmt::format("{}: metadata '{}' is missing", what, key));
  try {
    size_t pos = 0;
    const long long v = std::stoll(it->second, &pos);
    if (pos == it->second.size() && v >= 0) return int64_t(v);
  } catch (const std::exception&) {
  }
  throw Error(fmt::format("{}: metadata '{}' must be a non-negative integer, got \"{}\"", what, key,
                          it->second));
}

}  // namespace

// ---- policies
// -------------------------------------------------------------------------------------

NonfinitePolicy parse_nonfinite_policy(const std::string& s) {
  if (s == "stop") return NonfinitePolicy::stop;
  if (s == "skip") return NonfinitePolicy::skip;
  throw Error(fmt::format("the non-finite policy must be \"stop\" or \"skip\", got \"{}\"", s));
}

const char* nonfinite_policy_name(NonfinitePolicy p) {
  return p == NonfinitePolicy::stop ? "stop" : "skip";
}

// ---- the training config ----------------------------------------------------------------------

const std::vector<std::string>& train_config_keys() {
  static const std::vector<std::string> k = {"model",
                                             "dtype",
                                             "recompute",
                                             "mtp",
                                             "steps",
                                             "tokens_per_step",
                                             "seed",
                                             "schedule",
                                             "lr",
                                             "warmup_steps",
                                             "min_lr_ratio",
                                             "decay_steps",
                                             "weight_decay",
                                             "beta1",
                                             "beta2",
                                             "eps",
                                             "grad_clip",
                                             "eval_interval",
                                             "eval_batches",
                                             "log_interval",
                                             "checkpoint_interval",
                                             "dsa_dense_warmup_steps",
                                             "nonfinite",
                                             "data",
                                             "tokenizer",
                                             "seq_len",
                                             "shuffle",
                                             "mqar"};
  return k;
}

namespace {

// The model config of a training config: `model` (a path, read relative to base_dir, or an
// inline object; absent: configs/tiny.json), then its `model_overrides`, then `extra` overrides,
// parsed once. Sets c.model and c.model_source.
void read_model(JsonReader& r, const std::vector<std::string>& extra, const std::string& base_dir,
                TrainConfig& c) {
  json m;
  const json* v = r.find("model");
  if (!v) {
    c.model_source = resolve_path("configs/tiny.json", base_dir);
    m = read_json_file(c.model_source);
  } else if (v->is_string()) {
    c.model_source = resolve_path(v->get<std::string>(), base_dir);
    m = read_json_file(c.model_source);
  } else if (v->is_object()) {
    c.model_source = "inline";
    m = *v;
  } else {
    r.fail("model", "a model config path or an inline config object", *v);
  }
  std::vector<std::string> overrides;
  if (const json* l = r.find("model_overrides")) {
    if (!l->is_array()) r.fail("model_overrides", "a list of \"key=value\" strings", *l);
    for (size_t i = 0; i < l->size(); ++i) {
      const std::string name = fmt::format("model_overrides[{}]", i);
      overrides.push_back(r.to_string((*l)[i], name));
      if (overrides.back().find('=') == std::string::npos)
        r.fail(name, "a \"key=value\" string", (*l)[i]);
    }
  }
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  apply_overrides(m, overrides);
  if (!overrides.empty()) c.model_source += " with " + join(overrides, " ");
  c.model = ModelConfig::from_json(m, "model config (" + c.model_source + ")");
}

// The training config of `j`, not validated.
TrainConfig parse_train_config(const json& j, const std::string& what, const std::string& base_dir,
                               const std::vector<std::string>& model_overrides) {
  JsonReader r(j, what);
  TrainConfig c;
  // "model" and "model_overrides" are read last, after the unknown-key check, so that a
  // misspelt key is named before the default model config is looked for.
  r.mark("model");
  r.mark("model_overrides");
  c.dtype = r.get_enum("dtype", c.dtype,
                       {{"f32", DType::f32},
                        {"float32", DType::f32},
                        {"bf16", DType::bf16},
                        {"bfloat16", DType::bf16},
                        {"f64", DType::f64},
                        {"float64", DType::f64}});
  c.recompute = r.get_parsed("recompute", c.recompute, parse_recompute);
  c.mtp = r.get_bool("mtp", c.mtp);
  c.steps = r.get_int("steps", c.steps);
  c.tokens_per_step = r.get_int("tokens_per_step", c.tokens_per_step);
  c.seed = uint64_t(r.get_int("seed", int64_t(c.seed), {0, std::numeric_limits<int64_t>::max()}));
  c.schedule = r.get_parsed("schedule", c.schedule, parse_schedule_kind);
  c.lr = r.get_double("lr", c.lr);
  c.warmup_steps = r.get_int("warmup_steps", c.warmup_steps);
  c.min_lr_ratio = r.get_double("min_lr_ratio", c.min_lr_ratio);
  c.decay_steps = r.get_int("decay_steps", c.decay_steps);
  c.adamw.weight_decay = r.get_double("weight_decay", c.adamw.weight_decay);
  c.adamw.beta1 = r.get_double("beta1", c.adamw.beta1);
  c.adamw.beta2 = r.get_double("beta2", c.adamw.beta2);
  c.adamw.eps = r.get_double("eps", c.adamw.eps);
  c.adamw.max_grad_norm = r.get_double("grad_clip", c.adamw.max_grad_norm);
  c.eval_interval = r.get_int("eval_interval", c.eval_interval);
  c.eval_batches = r.get_int("eval_batches", c.eval_batches);
  c.log_interval = r.get_int("log_interval", c.log_interval);
  c.checkpoint_interval = r.get_int("checkpoint_interval", c.checkpoint_interval);
  c.dsa_dense_warmup_steps = r.get_int("dsa_dense_warmup_steps", c.dsa_dense_warmup_steps);
  c.nonfinite = r.get_parsed("nonfinite", c.nonfinite, parse_nonfinite_policy);
  c.data_path = resolve_path(r.opt_string("data").value_or(""), base_dir);
  c.tokenizer_path = resolve_path(r.opt_string("tokenizer").value_or(""), base_dir);
  c.seq_len = r.get_int("seq_len", c.seq_len);
  c.shuffle = r.get_bool("shuffle", c.shuffle);
  // mqar: vocab_size and num_keys default to 0 (resolved against the model in mqar_config()).
  c.mqar.vocab_size = 0;
  c.mqar.num_keys = 0;
  if (r.has("mqar")) {
    JsonReader m = r.child("mqar");
    c.mqar.vocab_size = m.get_int("vocab_size", c.mqar.vocab_size);
    c.mqar.num_keys = m.get_int("num_keys", c.mqar.num_keys);
    c.mqar.min_pairs = m.get_int("min_pairs", c.mqar.min_pairs);
    c.mqar.max_pairs = m.get_int("max_pairs", c.mqar.max_pairs);
    c.mqar.query_fraction = m.get_double("query_fraction", c.mqar.query_fraction);
    c.mqar.loss_on_all_tokens = m.get_bool("loss_on_all_tokens", c.mqar.loss_on_all_tokens);
    m.check_unknown_keys({},
                         "(known mqar keys: vocab_size, num_keys, min_pairs, max_pairs, "
                         "query_fraction, loss_on_all_tokens)");
  }
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!it.key().empty() && it.key()[0] == '_') r.mark(it.key());  // "_comment" and the like
  const std::vector<std::string> unknown = r.unread_keys();
  if (!unknown.empty())
    r.check_unknown_keys({}, fmt::format("(known keys: {}; a model config field goes under "
                                         "\"model\" or is set with --set model.{}=...)",
                                         join(train_config_keys()), unknown[0]));
  read_model(r, model_overrides, base_dir, c);
  return c;
}

}  // namespace

TrainConfig TrainConfig::from_json(const json& j, const std::string& what,
                                   const std::string& base_dir) {
  TrainConfig c = parse_train_config(j, what, base_dir, {});
  c.validate(what);
  return c;
}

json TrainConfig::to_json() const {
  json j = json::object();
  j["model"] = model.to_json();
  j["dtype"] = dtype_name(dtype);
  j["recompute"] = recompute_name(recompute);
  j["mtp"] = mtp;
  j["steps"] = steps;
  j["tokens_per_step"] = tokens_per_step;
  j["seed"] = seed;
  j["schedule"] = schedule_kind_name(schedule);
  j["lr"] = lr;
  j["warmup_steps"] = warmup_steps;
  j["min_lr_ratio"] = min_lr_ratio;
  j["decay_steps"] = decay_steps;
  j["weight_decay"] = adamw.weight_decay;
  j["beta1"] = adamw.beta1;
  j["beta2"] = adamw.beta2;
  j["eps"] = adamw.eps;
  j["grad_clip"] = adamw.max_grad_norm;
  j["eval_interval"] = eval_interval;
  j["eval_batches"] = eval_batches;
  j["log_interval"] = log_interval;
  j["checkpoint_interval"] = checkpoint_interval;
  j["dsa_dense_warmup_steps"] = dsa_dense_warmup_steps;
  j["nonfinite"] = nonfinite_policy_name(nonfinite);
  j["data"] = data_path;
  j["tokenizer"] = tokenizer_path;
  j["seq_len"] = seq_len;
  j["shuffle"] = shuffle;
  j["mqar"] = {
      {"vocab_size", mqar.vocab_size},         {"num_keys", mqar.num_keys},
      {"min_pairs", mqar.min_pairs},           {"max_pairs", mqar.max_pairs},
      {"query_fraction", mqar.query_fraction}, {"loss_on_all_tokens", mqar.loss_on_all_tokens}};
  return j;
}

MqarConfig TrainConfig::mqar_config() const {
  MqarConfig m = mqar;
  if (m.vocab_size == 0) m.vocab_size = model.vocab_size;
  if (m.num_keys == 0) m.num_keys = m.vocab_size / 2;
  m.tokens_per_step = tokens_per_step;
  m.eval_batches = eval_batches;
  m.seed = seed;
  return m;
}

ScheduleConfig TrainConfig::schedule_config() const {
  ScheduleConfig s;
  s.kind = schedule;
  s.lr = lr;
  s.total_steps = decay_steps > 0 ? decay_steps : steps;
  s.warmup_steps = std::min(warmup_steps, s.total_steps);  // a short run warms up over all of it
  s.min_lr_ratio = min_lr_ratio;
  return s;
}

void TrainConfig::validate(const std::string& what) const {
  auto need = [&](bool ok, const std::string& msg) {
    if (!ok) throw Error(fmt::format("{}: {}", what, msg));
  };
  need(steps >= 1, fmt::format("'steps' must be >= 1, got {}", steps));
  need(tokens_per_step >= 1,
       fmt::format("'tokens_per_step' must be >= 1, got {}", tokens_per_step));
  need(std::isfinite(lr) && lr >= 0, fmt::format("'lr' must be finite and >= 0, got {}", lr));
  need(warmup_steps >= 0, fmt::format("'warmup_steps' must be >= 0, got {}", warmup_steps));
  need(decay_steps >= 0, fmt::format("'decay_steps' must be >= 0 (0: steps), got {}", decay_steps));
  need(min_lr_ratio >= 0 && min_lr_ratio <= 1,
       fmt::format("'min_lr_ratio' must be in [0, 1], got {}", min_lr_ratio));
  need(adamw.beta1 >= 0 && adamw.beta1 < 1,
       fmt::format("'beta1' must be in [0, 1), got {}", adamw.beta1));
  need(adamw.beta2 >= 0 && adamw.beta2 < 1,
       fmt::format("'beta2' must be in [0, 1), got {}", adamw.beta2));
  need(adamw.eps > 0 && std::isfinite(adamw.eps),
       fmt::format("'eps' must be finite and > 0, got {}", adamw.eps));
  need(std::isfinite(adamw.weight_decay) && adamw.weight_decay >= 0,
       fmt::format("'weight_decay' must be finite and >= 0, got {}", adamw.weight_decay));
  need(std::isfinite(adamw.max_grad_norm),
       fmt::format("'grad_clip' must be finite (<= 0: no clipping), got {}", adamw.max_grad_norm));
  need(eval_interval >= 0, fmt::format("'eval_interval' must be >= 0, got {}", eval_interval));
  need(eval_batches >= 1, fmt::format("'eval_batches' must be >= 1, got {}", eval_batches));
  need(log_interval >= 0, fmt::format("'log_interval' must be >= 0, got {}", log_interval));
  need(checkpoint_interval >= 0,
       fmt::format("'checkpoint_interval' must be >= 0 (0: only at the end), got {}",
                   checkpoint_interval));
  need(dsa_dense_warmup_steps >= -1,
       fmt::format("'dsa_dense_warmup_steps' must be >= 0, or -1 (the whole run), got {}",
                   dsa_dense_warmup_steps));
  need(seq_len >= 0, fmt::format("'seq_len' must be >= 0 (0: tokens_per_step), got {}", seq_len));
  need(mqar.vocab_size >= 0 && mqar.num_keys >= 0,
       "'mqar.vocab_size' and 'mqar.num_keys' must be >= 0 (0: from the model)");
  model.validate("model config (" + model_source + ")");
  need(tokenizer_path.empty() || !data_path.empty(),
       "'tokenizer' encodes a text file given as 'data' (--data), and there is none");
  need(tokenizer_path.empty() || fs::path(data_path).extension() != ".bin",
       fmt::format("'tokenizer' encodes text, but 'data' {} is a .bin of token ids already",
                   data_path));
  if (data_path.empty()) {
    const MqarConfig m = mqar_config();
    need(m.vocab_size <= model.vocab_size,
         fmt::format("'mqar.vocab_size' {} exceeds the model's vocab_size {}", m.vocab_size,
                     model.vocab_size));
    try {
      MqarTask check(m);
    } catch (const Error& e) {
      throw Error(fmt::format("{}: MQAR settings: {}", what, e.what()));
    }
  }
  try {
    LrSchedule check(schedule_config());
  } catch (const Error& e) {
    throw Error(fmt::format("{}: schedule settings: {}", what, e.what()));
  }
}

json read_train_config_file(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error(fmt::format("training config '{}' does not exist", path));
  return read_json_file(path);
}

SplitOverrides split_overrides(const std::vector<std::string>& key_values) {
  SplitOverrides s;
  const auto& known = train_config_keys();
  for (const auto& kv : key_values) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0)
      throw Error(fmt::format("--set '{}': expected key=value", kv));
    const std::string key = kv.substr(0, eq);
    if (key.rfind("model.", 0) == 0) {
      s.model.push_back(kv.substr(6));
      continue;
    }
    const std::string first = key.substr(0, key.find('.'));
    if (std::find(known.begin(), known.end(), first) != known.end())
      s.train.push_back(kv);
    else
      s.model.push_back(kv);
  }
  return s;
}

TrainConfig make_train_config(json j, const std::vector<std::string>& overrides,
                              const std::string& what, const std::string& base_dir,
                              const std::function<void(TrainConfig&)>& adjust) {
  const JsonReader top(j, what);  // throws unless j is an object
  const SplitOverrides ov = split_overrides(overrides);
  for (const auto& kv : ov.train) {
    const size_t eq = kv.find('=');
    apply_override(j, kv.substr(0, eq), kv.substr(eq + 1));
  }
  const std::string label = overrides.empty() ? what : what + " with --set " + join(overrides, " ");
  TrainConfig c;
  try {
    // The model config: loaded, then the file's model_overrides, then the --set ones.
    c = parse_train_config(j, label, base_dir, ov.model);
  } catch (const Error& e) {
    if (ov.model.empty()) throw;
    throw Error(fmt::format("{} (model overrides: {})", e.what(), join(ov.model, " ")));
  }
  if (adjust) adjust(c);
  c.validate(label);
  return c;
}

// ---- checkpoint reading -----------------------------------------------------------------------

TrainerCheckpoint read_trainer_checkpoint(const std::string& dir, bool check_lock) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw Error(fmt::format("'{}' is not a directory: no training run to resume", dir));
  if (check_lock)
    RunLock::check_free(dir);  // a run still writing there: say so, not "damaged" or "missing"
  const std::string path = path_in(dir, kTrainerStateFile);
  if (!fs::exists(path, ec))
    throw Error(fmt::format(
        "'{}' holds no training checkpoint ({} is missing; a run stopped before its first "
        "checkpoint can be started again there with --out {})",
        dir, kTrainerStateFile, dir));
  TrainerCheckpoint ck;
  try {
    ck.state = checkpoint::load_tensor_map(path, true);
  } catch (const Error& e) {
    throw Error(fmt::format(
        "{}: the checkpoint cannot be read (damaged or not a trainer state): {}", path, e.what()));
  }
  const auto& m = ck.state.metadata;
  auto it = m.find("hlm_trainer_state");
  if (it == m.end() || it->second != "1")
    throw Error(fmt::format("{}: not a trainer state (metadata 'hlm_trainer_state' is {})", path,
                            it == m.end() ? "missing" : "\"" + it->second + "\""));
  ck.step = parse_meta_int(m, "step", path);
  ck.skipped_steps = parse_meta_int(m, "skipped_steps", path);
  HLM_CHECK(ck.skipped_steps <= ck.step, "{}: metadata 'skipped_steps' {} exceeds 'step' {}", path,
            ck.skipped_steps, ck.step);
  auto tc = m.find("train_config");
  if (tc == m.end()) throw Error(fmt::format("{}: metadata 'train_config' is missing", path));
  try {
    ck.train_config = json::parse(tc->second);
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: metadata 'train_config' is not valid JSON: {}", path, e.what()));
  }
  if (!ck.train_config.is_object() || !ck.train_config.contains("model") ||
      !ck.train_config["model"].is_object())
    throw Error(
        fmt::format("{}: metadata 'train_config' must be an object with an inline 'model'", path));
  auto st = ck.state.tensors.find("optimizer.step");
  if (st == ck.state.tensors.end())
    throw Error(fmt::format("{}: tensor 'optimizer.step' is missing", path));
  if (st->second.dtype() != DType::i64 || st->second.numel() != 1)
    throw Error(fmt::format("{}: tensor 'optimizer.step' must be an i64 scalar, got {}", path,
                            st->second.describe()));
  const int64_t opt_step = st->second.contiguous().data<int64_t>()[0];
  if (opt_step != ck.step - ck.skipped_steps)
    throw Error(
        fmt::format("{}: the optimizer made {} updates, but step {} with {} skipped means {}", path,
                    opt_step, ck.step, ck.skipped_steps, ck.step - ck.skipped_steps));
  return ck;
}

// ---- the trainer ----------------------------------------------------------------------------

Trainer::Trainer(const TrainConfig& cfg, const TrainerOptions& opts) : cfg_(cfg), opts_(opts) {
  cfg_.validate();
  HLM_CHECK(!opts_.out_dir.empty(), "trainer: the output directory is empty");
  HLM_CHECK(!opts_.stop_after || *opts_.stop_after >= 0, "trainer: stop_after must be >= 0, got {}",
            opts_.stop_after.value_or(0));
  // Every count bounded and the memory of a step estimated before anything large is allocated
  // or the run directory is created.
  check_train_limits(cfg_, cfg_.model);
  const int nproc = opts_.comm ? opts_.comm->size() : 1;
  root_ = !opts_.comm || opts_.comm->rank() == 0;
  if (!root_) {
    opts_.log = nullptr;
    opts_.plot = false;
    opts_.print_summary = false;
  }
  HLM_CHECK(nproc == 1 || opts_.device == Device::cpu || dist::have_nccl(),
            "--device {} with {} processes: data parallelism on GPUs needs the NCCL backend, "
            "which this build lacks (a CUDA build finds nccl.h and libnccl)",
            device_name(opts_.device), nproc);
  if (opts_.device != Device::cpu) {
    HLM_CHECK(cuda_available(), "--device {}: no CUDA device is present",
              device_name(opts_.device));
    HLM_CHECK(cfg_.model.precision.default_kind != GemmKind::fp8_block,
              "--device {}: the FP8 block GEMMs (gemm_precision fp8_block) have no CUDA "
              "implementation yet; use gemm_precision bf16 or native",
              device_name(opts_.device));
  }
  const int ep = opts_.expert_parallel;
  if (ep != 1) {
    const int64_t E = cfg_.model.moe.n_routed_experts;
    HLM_CHECK(ep >= 1 && nproc % ep == 0,
              "--expert-parallel {}: the degree must be at least 1 and divide the number of "
              "processes, {}",
              ep, nproc);
    bool any_moe =
        cfg_.mtp && cfg_.model.mtp.num_layers > 0 && cfg_.model.mtp_mlp_kind() == MlpKind::moe;
    for (int64_t l = 0; l < cfg_.model.num_hidden_layers; ++l)
      any_moe = any_moe || cfg_.model.is_moe_layer(l);
    HLM_CHECK(any_moe, "--expert-parallel {}: the model has no MoE layer", ep);
    HLM_CHECK(E % ep == 0,
              "--expert-parallel {}: the degree must divide the experts of a MoE layer, {}", ep, E);
  }
  const int cp = opts_.context_parallel;
  if (cp != 1) {
    HLM_CHECK(cp >= 1 && nproc % cp == 0,
              "--context-parallel {}: the degree must be at least 1 and divide the number of "
              "processes, {}",
              cp, nproc);
    HLM_CHECK(opts_.cp_mode != KdaCpMode::headwise || cfg_.model.kda.num_heads % cp == 0,
              "--cp-mode headwise: the KDA layers' {} heads do not divide by the degree {}",
              cfg_.model.kda.num_heads, cp);
  }
  const int tp = opts_.tensor_parallel;
  if (tp != 1) {
    HLM_CHECK(tp >= 1 && nproc % tp == 0,
              "--tensor-parallel {}: the degree must divide the number of processes, {}", tp,
              nproc);
    HLM_CHECK(nproc % (tp * cp) == 0,
              "--tensor-parallel {} --context-parallel {}: their product must divide the number "
              "of processes, {}",
              tp, cp, nproc);
    HLM_CHECK(cp == 1 || opts_.cp_mode != KdaCpMode::headwise ||
                  cfg_.model.kda.num_heads % (tp * cp) == 0,
              "--tensor-parallel {} --cp-mode headwise: each rank's {} KDA heads do not divide by "
              "the context-parallel degree {}",
              tp, cfg_.model.kda.num_heads / tp, cp);
    HLM_CHECK(ep == 1 || (nproc / tp) % ep == 0,
              "--tensor-parallel {} --expert-parallel {}: the expert groups are made of the {} "
              "data-parallel groups' ranks, and {} does not divide them",
              tp, ep, nproc / tp, ep);
    const ModelConfig& m = cfg_.model;
    const bool mtp = cfg_.mtp && m.mtp.num_layers > 0;
    if (m.count_layers(LayerKind::kda) > 0)
      HLM_CHECK(m.kda.num_heads % tp == 0,
                "--tensor-parallel {}: the KDA layers' {} heads do not divide by the degree", tp,
                m.kda.num_heads);
    if (m.count_layers(LayerKind::dsa) + m.count_layers(LayerKind::mla) > 0 || mtp)
      HLM_CHECK(m.mla.num_heads % tp == 0,
                "--tensor-parallel {}: the MLA layers' {} heads do not divide by the degree", tp,
                m.mla.num_heads);
    bool dense = mtp && m.mtp_mlp_kind() == MlpKind::dense;
    for (int64_t l = 0; l < m.num_hidden_layers; ++l) dense = dense || !m.is_moe_layer(l);
    if (dense)
      HLM_CHECK(m.intermediate_size % tp == 0,
                "--tensor-parallel {}: the dense MLPs' {} channels do not divide by the degree", tp,
                m.intermediate_size);
  }
  const bool gpu = opts_.device != Device::cpu;
  // One GPU per rank of this host, before anything is allocated there.
  if (nproc > 1 && gpu) cuda_select_device(dist::local_rank() % cuda_device_count());
  if (tp > 1) {
    // Tensor-parallel group g: the ranks [g tp, (g + 1) tp); data parallel over the groups: the
    // ranks of one tensor-parallel rank, in rank order. Over NCCL on GPUs.
    const int r = opts_.comm->rank();
    tp_host_ = opts_.comm->split(r / tp, r);
    if (nproc > tp) dp_host_ = opts_.comm->split(r % tp, r);
    if (gpu) {
      tp_dev_ = dist::nccl_comm(*tp_host_);
      if (dp_host_) dcomm_ = dist::nccl_comm(*dp_host_);
    }
    tp_ = tp_dev_ ? tp_dev_.get() : tp_host_.get();
  } else if (nproc > 1 && gpu) {
    dcomm_ = dist::nccl_comm(*opts_.comm);
  }
  // Expert groups over the data-parallel ranks (under tensor parallelism: those of one
  // tensor-parallel rank, which hold different tokens).
  if (ep > 1)
    groups_ = std::make_unique<ExpertGroups>(
        make_expert_groups(tp_ ? *dp_host_ : *opts_.comm, ep, opts_.device != Device::cpu));
  // Context-parallel group g: the ranks [g cp, (g + 1) cp), in rank order. With tensor
  // parallelism rank r is ((d cp + c) tp + a): part d of the batch, context rank c, tensor rank
  // a; the context group is the ranks of one (d, a), and the tensor-context group the cp x tp
  // ranks of part d.
  if (cp > 1) {
    const int r = opts_.comm->rank();
    if (tp > 1) {
      cp_comm_ = opts_.comm->split((r / (tp * cp)) * tp + r % tp, r);
      tcp_comm_ = opts_.comm->split(r / (tp * cp), r);
    } else {
      cp_comm_ = opts_.comm->split(r / cp, r);
    }
    if (gpu) cp_dev_ = dist::nccl_comm(*cp_comm_);
  }
  HybridModelOptions mo;
  mo.dtype = cfg_.dtype;
  mo.seed = cfg_.seed;
  mo.recompute = cfg_.recompute;
  mo.mtp = cfg_.mtp;
  mo.expert_comm = groups_ ? groups_->dispatch() : nullptr;
  mo.tensor_comm = tp_;
  mo.tensor_context_comm = tcp_comm_.get();
  model_ = std::make_unique<HybridModel>(cfg_.model, mo);
  model_->zero_grad();
  if (tp_) {
    tp_layouts_ = model_->tensor_parallel_params();
    for (const TpParam& l : tp_layouts_)
      if (l.split == TpSplit::rows || l.split == TpSplit::cols) tp_split_[l.name] = &l;
  }
  if (groups_)
    for (Param* p : model_->expert_params()) split_experts_.insert(p);
  // The data-parallel ranks: every rank, or under tensor parallelism the ranks of this one's
  // tensor-parallel rank (each holding the same parts).
  dist::Comm* dp_comm = tp_ ? dp_host_.get() : (nproc > 1 ? opts_.comm : nullptr);
  if (dp_comm) {
    dp_ = groups_
              ? std::make_unique<DataParallel>(*dp_comm, model_->named_parameters(), dcomm_.get(),
                                               *groups_, model_->expert_params())
              : std::make_unique<DataParallel>(*dp_comm, model_->named_parameters(), dcomm_.get());
    opt_ = std::make_unique<AdamW>(dp_->owned(), cfg_.adamw);
  } else {
    opt_ = std::make_unique<AdamW>(model_->named_parameters(), cfg_.adamw);
  }
  sched_ = std::make_unique<LrSchedule>(cfg_.schedule_config());
  if (cfg_.data_path.empty()) {
    auto t = std::make_unique<MqarTask>(cfg_.mqar_config());
    mqar_ = t.get();
    data_ = std::move(t);
  } else {
    TokenStreamConfig tc;
    tc.tokens_per_step = cfg_.tokens_per_step;
    tc.seq_len = cfg_.seq_len;
    tc.shuffle = cfg_.shuffle;
    tc.seed = cfg_.seed;
    const bool is_bin = fs::path(cfg_.data_path).extension() == ".bin";
    if (!cfg_.tokenizer_path.empty()) {
      data_ = open_tokenized_text(tc);
    } else {
      HLM_CHECK(
          is_bin || cfg_.model.vocab_size >= kByteVocab,
          "--data {} is byte-level text: it needs a model vocab_size of at least {} (256 bytes "
          "+ BOS + EOS), the model has {} (add --set model.vocab_size={})",
          cfg_.data_path, kByteVocab, cfg_.model.vocab_size, kByteVocab);
      data_ = open_data_file(cfg_.data_path, cfg_.model.vocab_size, tc);
    }
    HLM_CHECK(data_->vocab_size() <= cfg_.model.vocab_size,
              "--data {}: the data needs a vocabulary of {} tokens, the model has vocab_size {} "
              "(set model.vocab_size={})",
              cfg_.data_path, data_->vocab_size(), cfg_.model.vocab_size, data_->vocab_size());
  }
  // Every part needs a sequence of each global batch, and every slice of a part a token (the
  // first batch tells; all are alike).
  if (dp_ || tp_) {
    const Batch part =
        dp_ ? shard_batch(data_->batch(1), dp_->rank() / cp, dp_->size() / cp) : data_->batch(1);
    HLM_CHECK(part.num_tokens() >= cp,
              "--context-parallel {}: a part of the global batch holds {} tokens, fewer than the "
              "degree (raise tokens_per_step)",
              cp, part.num_tokens());
    // A tensor-parallel MoE layer gives every rank of the group a share of its rows (of the
    // part, or of each context slice of it).
    HLM_CHECK(!tp_ || part.num_tokens() >= int64_t(tp_->size()) * cp,
              "--tensor-parallel {}: a part of the global batch holds {} tokens, fewer than {} "
              "(the degree times the context-parallel degree; raise tokens_per_step)",
              tp_ ? tp_->size() : 1, part.num_tokens(), int64_t(tp_ ? tp_->size() : 1) * cp);
  }
  if (opts_.resume) {
    // The lock before the state is read: a run still writing there is refused, not raced.
    std::error_code ec;
    if (root_ && (fs::exists(path_in(opts_.out_dir, kTrainerStateFile), ec) ||
                  fs::exists(path_in(opts_.out_dir, kLockFile), ec)))
      lock_ = std::make_unique<RunLock>(opts_.out_dir);
    resume_from_checkpoint();
    HLM_CHECK(!opts_.stop_after || *opts_.stop_after >= step_,
              "--stop-after {}: the checkpoint in {} is already at step {}", *opts_.stop_after,
              opts_.out_dir, step_);
  }
  start_step_ = step_;
}

Trainer::~Trainer() = default;

std::unique_ptr<DataSource> Trainer::open_tokenized_text(TokenStreamConfig tc) const {
  const tokenizer::Tokenizer tok = tokenizer::Tokenizer::load(cfg_.tokenizer_path);
  HLM_CHECK(tok.vocab_size() <= cfg_.model.vocab_size,
            "--tokenizer {}: its vocabulary has {} ids, more than the model's vocab_size {} (set "
            "model.vocab_size={} or more)",
            tok.source(), tok.vocab_size(), cfg_.model.vocab_size, tok.vocab_size());
  // BOS / EOS: those tokenizer_config.json names, else those of the model config (its first
  // eos_token_id), else none; each must be a token of the tokenizer.
  const auto pick = [&](std::optional<uint32_t> from_tok, std::optional<int64_t> from_model,
                        const char* what) -> int64_t {
    if (from_tok) return int64_t(*from_tok);
    if (!from_model) return -1;
    HLM_CHECK(*from_model < tok.vocab_size(),
              "--tokenizer {}: the model config's {} {} is not a token of the tokenizer (ids "
              "0..{})",
              tok.source(), what, *from_model, tok.vocab_size() - 1);
    tok.id_to_token(uint32_t(*from_model));  // an id without a token is an error
    return *from_model;
  };
  const auto& m = cfg_.model;
  tc.bos_id = pick(tok.bos_token(), m.bos_token_id, "bos_token_id");
  tc.eos_id =
      pick(tok.eos_token(),
           m.eos_token_ids.empty() ? std::nullopt : std::optional<int64_t>(m.eos_token_ids[0]),
           "eos_token_id");
  return open_text_file(cfg_.data_path, tok, tc);
}

void Trainer::log(const std::string& line) const {
  if (!opts_.log) return;
  std::fprintf(opts_.log, "%s\n", line.c_str());
  std::fflush(opts_.log);
}

double Trainer::chance_accuracy() const {
  return mqar_ ? mqar_->chance_accuracy() : 0.0;
}

void Trainer::resume_from_checkpoint() {
  const std::string& dir = opts_.out_dir;
  TrainerCheckpoint ck = read_trainer_checkpoint(dir, root_);
  const std::string state_path = path_in(dir, kTrainerStateFile);
  TrainConfig ckcfg;
  try {
    ckcfg = TrainConfig::from_json(ck.train_config, state_path + " (train_config)");
  } catch (const Error& e) {
    throw Error(fmt::format("{}: the stored training config is invalid: {}", state_path, e.what()));
  }
  const ModelConfig& ckm = ckcfg.model;
  if (!(ckm == cfg_.model)) {
    const auto diff = json_differences(ckm.to_json(), cfg_.model.to_json());
    throw Error(fmt::format(
        "--resume {}: the model config differs from the checkpoint's ({}); a resumed run keeps "
        "its model",
        dir, diff.empty() ? "structure" : join(diff, "; ")));
  }
  HLM_CHECK(ckcfg.dtype == cfg_.dtype && ckcfg.mtp == cfg_.mtp,
            "--resume {}: the checkpoint was trained with dtype {} and mtp {}, this run asks for "
            "dtype {} and mtp {}",
            dir, dtype_name(ckcfg.dtype), ckcfg.mtp, dtype_name(cfg_.dtype), cfg_.mtp);
  try {
    if (dp_) {
      // This rank's shard, then every parameter's value from its owner.
      opt_->load_state_dict(
          dp_->shard_state(tp_ ? tp_convert(ck.state.tensors, true) : ck.state.tensors,
                           "optimizer."),
          "optimizer.");
      dp_->share_values();
    } else {
      // Tensor parallel: this rank's parts of the whole state.
      opt_->load_state_dict(tp_ ? tp_convert(ck.state.tensors, true) : ck.state.tensors,
                            "optimizer.");
    }
  } catch (const Error& e) {
    throw Error(
        fmt::format("{}: the optimizer state does not fit the model: {}", state_path, e.what()));
  }
  // Tensors outside the optimizer's prefix have no place in a trainer state.
  for (const auto& [name, t] : ck.state.tensors)
    HLM_CHECK(name.rfind("optimizer.", 0) == 0, "{}: unexpected tensor '{}'", state_path, name);
  step_ = ck.step;
  skipped_ = ck.skipped_steps;
  HLM_CHECK(cfg_.steps >= step_,
            "--resume {}: the checkpoint is at step {}, past the requested total of {} steps "
            "(--steps N sets the total)",
            dir, step_, cfg_.steps);

  // The HF-layout copy of the weights: it must be readable, and when it is of the same step it
  // must equal the weights restored from the masters (else the checkpoint was modified).
  std::error_code ec;
  const std::string cfg_path = path_in(dir, checkpoint::kConfigFile);
  if (fs::exists(cfg_path, ec)) {
    ModelConfig on_disk;
    try {
      on_disk = ModelConfig::load(cfg_path);
    } catch (const Error& e) {
      throw Error(
          fmt::format("--resume {}: {} is damaged: {}", dir, checkpoint::kConfigFile, e.what()));
    }
    if (!(on_disk == cfg_.model)) {
      const auto diff = json_differences(on_disk.to_json(), cfg_.model.to_json());
      throw Error(
          fmt::format("--resume {}: {} differs from the model config stored in {} ({}); "
                      "the checkpoint was modified",
                      dir, checkpoint::kConfigFile, kTrainerStateFile, join(diff, "; ")));
    }
  }
  const std::string w_path = path_in(dir, checkpoint::kSingleFile);
  if (fs::exists(w_path, ec)) {
    safetensors::Contents w;
    try {
      w = checkpoint::load_tensor_map(w_path, true);
    } catch (const Error& e) {
      throw Error(
          fmt::format("--resume {}: {} is damaged: {}", dir, checkpoint::kSingleFile, e.what()));
    }
    auto it = w.metadata.find("hlm_train_step");
    const int64_t wstep =
        it == w.metadata.end() ? -1 : parse_meta_int(w.metadata, "hlm_train_step", w_path);
    if (wstep == step_) {
      auto params = model_->named_parameters();
      for (auto& [name, p] : params) {
        auto t = w.tensors.find(name);
        HLM_CHECK(t != w.tensors.end(), "--resume {}: {} lacks tensor '{}'", dir,
                  checkpoint::kSingleFile, name);
        // Under expert (tensor) parallelism an expert (a split) tensor is compared with this
        // rank's share (part) of it.
        Tensor want = t->second;
        if (const TpParam* split = tp_layout_of(name))
          want = tp_shard(want, *split, tp_->rank(), tp_->size());
        if (dp_) want = dp_->expert_share(name, want);
        HLM_CHECK(bit_equal(want, p->value),
                  "--resume {}: tensor '{}' of {} differs from the weights in {} (same step {}): "
                  "the checkpoint was modified",
                  dir, name, checkpoint::kSingleFile, kTrainerStateFile, step_);
      }
      HLM_CHECK(w.tensors.size() == params.size(),
                "--resume {}: {} holds {} tensors, the model has {}", dir, checkpoint::kSingleFile,
                w.tensors.size(), params.size());
    } else if (wstep > step_) {
      HLM_FAIL("--resume {}: {} is of step {}, newer than {} (step {}): the directory mixes runs",
               dir, checkpoint::kSingleFile, wstep, kTrainerStateFile, step_);
    } else {
      log(
          fmt::format("note: {} is of step {} (a save was interrupted); the weights of step {} "
                      "are restored from {}",
                      checkpoint::kSingleFile, wstep, step_, kTrainerStateFile));
    }
  }
  const auto changed = json_differences(ck.train_config, cfg_.to_json(), /*skip=*/{"model"});
  if (!changed.empty())
    log(fmt::format("note: resuming with changed settings: {}", join(changed, "; ")));
  if (ckcfg.schedule_config().total_steps != cfg_.schedule_config().total_steps)
    log(
        fmt::format("note: the learning-rate schedule's horizon changes from {} to {} steps: the "
                    "continuation differs from an uninterrupted run (set decay_steps to keep it)",
                    ckcfg.schedule_config().total_steps, cfg_.schedule_config().total_steps));
}

void Trainer::move_to_device() {
  if (opts_.device == Device::cpu) return;
  // The optimizer's state through its named tensors: host copies in, device tensors out.
  const safetensors::TensorMap state = opt_->state_dict("optimizer.");
  safetensors::TensorMap host;
  for (const auto& [k, t] : state) host[k] = t.clone();
  model_->to(opts_.device);
  model_->zero_grad();
  opt_ = std::make_unique<AdamW>(dp_ ? dp_->owned() : model_->named_parameters(), cfg_.adamw);
  opt_->load_state_dict(host, "optimizer.");
  log(fmt::format("device: {} (model and optimizer state moved after setup)",
                  device_name(opts_.device)));
}

Shape Trainer::whole_shape(const std::string& name, const Param& p) const {
  Shape s = p.value.shape();
  if (split_experts_.count(&p)) s[0] *= groups_->ep;
  if (const TpParam* l = tp_layout_of(name)) s[l->split == TpSplit::cols ? 1 : 0] *= tp_->size();
  return s;
}

const TpParam* Trainer::tp_layout_of(const std::string& key) const {
  if (!tp_) return nullptr;
  const std::string prefix = "optimizer.";
  const std::string name = key.rfind(prefix, 0) == 0 ? AdamW::state_param(key, prefix) : key;
  const auto it = tp_split_.find(name);
  return it == tp_split_.end() ? nullptr : it->second;
}

safetensors::TensorMap Trainer::tp_convert(const safetensors::TensorMap& in, bool to_parts) const {
  safetensors::TensorMap out;
  for (const auto& [key, t] : in) {  // (a map: every rank in the same order)
    const TpParam* l = tp_layout_of(key);
    if (!l)
      out[key] = t;
    else
      out[key] = to_parts ? tp_shard(t, *l, tp_->rank(), tp_->size()) : tp_gather(*tp_, t, *l);
  }
  return out;
}

GradNorm Trainer::tp_grad_norm() const {
  // The split parameters' squares are parts of the whole model's: summed over the group; every
  // other parameter's gradient is the same on every rank (tp_reduce_grads) and counts once. With
  // data parallelism, each rank's optimizer holds its shard of the parameters: both sums are
  // first added over the data-parallel ranks (rank order).
  const std::vector<double> per = opt_->grad_sum_squares_per_param();
  std::vector<double> sums{0, 0};  // split, other
  for (size_t i = 0; i < per.size(); ++i) sums[tp_layout_of(opt_->name(i)) ? 0 : 1] += per[i];
  if (dp_) dp_->allreduce(sums);
  const Tensor split = dist::allreduce_from(*tp_, Tensor::from_vector<double>({1}, {sums[0]}));
  return opt_->grad_norm_from(split.data<double>()[0] + sums[1]);
}

void Trainer::write_param_list() const {
  std::string text = "# name  dtype  shape  weight decay\n";
  int64_t decayed = 0, kept = 0, n_decayed = 0;
  std::map<std::string, int64_t> reasons;
  auto params = model_->named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const Param* p = params[i].second;
    const DecayDecision d = weight_decay_decision(*p, cfg_.adamw);
    const Shape whole = whole_shape(params[i].first, *p);
    std::string shape;
    for (int64_t s : whole) {
      if (!shape.empty()) shape += 'x';
      shape += std::to_string(s);
    }
    text += fmt::format("{}  {}  [{}]  {}{}\n", params[i].first, dtype_name(p->value.dtype()),
                        shape, d.decay ? "decay" : "no decay: ", d.decay ? "" : d.reason);
    if (d.decay)
      ++decayed, n_decayed += shape_numel(whole);
    else
      ++kept, ++reasons[d.reason];
  }
  checkpoint::write_file_atomic(path_in(opts_.out_dir, "parameters.txt"),
                                std::vector<uint8_t>(text.begin(), text.end()));
  std::vector<std::string> rs;
  for (auto& [r, n] : reasons) rs.push_back(fmt::format("{} {}", n, r));
  log(fmt::format("weight decay {}: {} tensors ({} values) decayed; {} not ({}); list in {}",
                  cfg_.adamw.weight_decay, decayed, n_decayed, kept, join(rs), "parameters.txt"));
}

EvalResult Trainer::evaluate() {
  EvalResult r;
  const Context ctx{false, false};
  double loss_sum = 0;
  auto one = [&](const Batch& b) {
    ModelInputs in;
    in.tokens = b.tokens;
    in.cu_seqlens = b.cu_seqlens;
    in.logits = true;
    ModelOutput out = model_->forward(ctx, in);
    const Tensor targets = out.logits.is_cpu() ? b.targets : b.targets.to(out.logits.device());
    const auto ce = ops::cross_entropy_forward(out.logits, targets);
    loss_sum += ce.loss * double(ce.count);
    r.targets += ce.count;
    if (mqar_)
      r.accuracy +=
          accuracy_from_logits(b, out.logits.is_cpu() ? out.logits : out.logits.to(Device::cpu));
  };
  if (mqar_) {
    r.has_accuracy = true;
    for (int64_t i = 0; i < mqar_->num_eval_batches(); ++i) one(mqar_->eval_batch(i));
  } else {
    // Token streams have no held-out split: batch(0), which no training step draws in the
    // first epoch (docs/training.md).
    one(data_->batch(0));
  }
  r.loss = r.targets > 0 ? loss_sum / double(r.targets) : 0.0;
  return r;
}

void Trainer::save() {
  const std::string& dir = opts_.out_dir;
  checkpoint::Metadata meta;
  meta["hlm_trainer_state"] = "1";
  meta["step"] = std::to_string(step_);
  meta["skipped_steps"] = std::to_string(skipped_);
  meta["train_config"] = cfg_.to_json().dump();
  // With N > 1 processes every rank sends its shard to rank 0, which writes the one-process
  // layout: under expert parallelism the experts' shares too, of the state and of the weights.
  safetensors::TensorMap state =
      dp_ ? dp_->gather_state(*opt_, "optimizer.") : opt_->state_dict("optimizer.");
  checkpoint::NamedTensors weights = checkpoint::module_tensors(*model_);
  // Tensor parallel: group 0 (the ranks of rank 0, which writes) gathers the whole tensors; the
  // data-parallel shards gave it the whole state above (the others hold none).
  if (tp_ && opts_.comm->rank() < tp_->size()) {
    state = tp_convert(state, false);
    for (auto& [name, t] : weights)
      if (const TpParam* l = tp_layout_of(name)) t = tp_gather(*tp_, t, *l);
  }
  if (groups_) {
    const auto params = model_->named_parameters();
    std::vector<size_t> at;
    std::vector<Tensor> shares;
    for (size_t i = 0; i < params.size(); ++i)
      if (split_experts_.count(params[i].second)) {
        at.push_back(i);
        shares.push_back(params[i].second->value);
      }
    const std::vector<Tensor> whole = dp_->gather_experts(shares);
    for (size_t j = 0; j < whole.size(); ++j) weights[at[j]].second = whole[j];
  }
  if (!root_) return;
  checkpoint::SaveOptions so;
  so.after_temp_written = opts_.hooks.after_temp_written;
  // The commit point first: once it is renamed, the checkpoint of step_ exists.
  checkpoint::save_tensor_map(path_in(dir, kTrainerStateFile), state, meta, so);
  checkpoint::SaveOptions mo;
  mo.metadata["hlm_train_step"] = std::to_string(step_);
  mo.after_temp_written = opts_.hooks.after_temp_written;
  checkpoint::save_module_tensors(dir, weights, &cfg_.model, mo);
  if (opts_.hooks.after_checkpoint) opts_.hooks.after_checkpoint(step_);
}

TrainSummary Trainer::run() {
  const double t_start = now_s();
  const std::string& dir = opts_.out_dir;
  // Ctrl-C / SIGTERM from here on end the run with a checkpoint (train/interrupt.h).
  std::optional<InterruptGuard> guard;
  if (opts_.handle_signals) guard.emplace();
  if (root_) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    HLM_CHECK(!ec && fs::is_directory(dir, ec), "run directory '{}' cannot be created: {}", dir,
              ec ? ec.message() : "a file of that name exists");
  }
  if (!lock_ && root_) lock_ = std::make_unique<RunLock>(dir);
  // The lock lasts as long as the run: released when run() returns or throws.
  struct Release {
    std::unique_ptr<RunLock>& lock;
    ~Release() { lock.reset(); }
  } release{lock_};
  if (root_) remove_stale_temporaries(dir);
  if (!opts_.resume && root_) {
    // A fresh run replaces what a previous run left here.
    std::error_code ec;
    for (const char* f : {kTrainerStateFile, checkpoint::kSingleFile, checkpoint::kConfigFile})
      fs::remove(path_in(dir, f), ec);
  }
  const int64_t end = opts_.stop_after ? std::min(*opts_.stop_after, cfg_.steps) : cfg_.steps;
  if (root_) {
    const std::string text = cfg_.to_json().dump(2) + "\n";
    checkpoint::write_file_atomic(path_in(dir, kTrainConfigFile),
                                  std::vector<uint8_t>(text.begin(), text.end()));
  }
  int64_t n_params = 0;  // the whole model's, experts split or not
  for (const auto& [name, p] : model_->named_parameters())
    n_params += shape_numel(whole_shape(name, *p));
  log(
      fmt::format("model: {} layers \"{}\", hidden {}, vocab {}, mHC {}x, {} MoE layers, MTP {}; "
                  "{} parameters ({}, recompute {})",
                  cfg_.model.num_hidden_layers, cfg_.model.layer_pattern(), cfg_.model.hidden_size,
                  cfg_.model.vocab_size, cfg_.model.mhc.streams(), model_->num_moe_layers(),
                  cfg_.mtp && cfg_.model.mtp.num_layers > 0 ? "on" : "off", n_params,
                  dtype_name(cfg_.dtype), recompute_name(cfg_.recompute)));
  log(fmt::format("model config: {}", cfg_.model_source));
  log(fmt::format("precision: {}", cfg_.model.precision_summary()));
  log(fmt::format("data: {}", data_->describe()));
  if (mqar_)
    log(fmt::format("chance accuracy {:.4f} (1 / {} values)", mqar_->chance_accuracy(),
                    mqar_->num_values()));
  log(fmt::format("schedule: {}; AdamW betas ({}, {}), eps {}, grad clip {}", sched_->describe(),
                  cfg_.adamw.beta1, cfg_.adamw.beta2, cfg_.adamw.eps, cfg_.adamw.max_grad_norm));
  if (dp_)
    log(fmt::format(
        "data parallel: {} processes ({} backend), each a part of every global batch "
        "(whole sequences); AdamW states sharded, rank 0 holds {} of {} parameter "
        "tensors",
        dp_->size(), dp_->comm().backend(), opt_->size(), model_->named_parameters().size()));
  if (groups_)
    log(fmt::format(
        "expert parallel: {} groups of {} processes, each process holding {} of every MoE "
        "layer's {} experts; the experts' gradients summed and their AdamW states sharded over "
        "the {} processes that hold the same experts",
        dp_->size() / groups_->ep, groups_->ep, cfg_.model.moe.n_routed_experts / groups_->ep,
        cfg_.model.moe.n_routed_experts, groups_->data->size()));
  if (cp_comm_)
    log(fmt::format(
        "context parallel: {} groups of {} processes ({} backend), each part of the global batch "
        "split along its tokens over a group (KDA layers {})",
        dp_->size() / cp_comm_->size(), cp_comm_->size(),
        cp_dev_ ? cp_dev_->backend() : cp_comm_->backend(),
        opts_.cp_mode == KdaCpMode::headwise ? "headwise" : "chunkwise"));
  if (tp_)
    log(fmt::format(
        "tensor parallel: {} groups of {} processes ({} backend), each process holding 1/{} of "
        "every attention layer's heads and dense MLP's channels and running its group's part "
        "of the batch; MoE layers on each process's share of the rows",
        (dp_ ? dp_->size() : 1), tp_->size(), tp_->backend(), tp_->size()));
  if (root_) write_param_list();
  move_to_device();
  if (opts_.resume)
    log(fmt::format("resumed from {} at step {} ({} skipped so far)", dir, step_, skipped_));
  log(fmt::format("training steps {}..{} of {} ({} tokens each) into {}", step_ + 1, end,
                  cfg_.steps, cfg_.tokens_per_step, dir));

  const std::string metrics_path = path_in(dir, kMetricsFile);
  std::unique_ptr<MetricsWriter> metrics;
  if (root_)
    metrics = std::make_unique<MetricsWriter>(
        metrics_path, opts_.resume ? std::optional<int64_t>(step_) : std::nullopt);
  std::unique_ptr<ProgressBar> bar;
  if (opts_.log && end > step_)
    bar = std::make_unique<ProgressBar>(end, step_, opts_.log, opts_.progress);
  auto line = [&](const std::string& s) {
    if (bar) bar->finish();
    log(s);
  };

  TrainSummary sum;
  sum.start_step = step_;
  sum.processes = dp_ ? dp_->size() : 1;
  sum.chance_accuracy = chance_accuracy();
  int64_t last_ckpt = opts_.resume ? step_ : -1;
  double train_time = 0, interval_time = 0;
  int64_t interval_tokens = 0;
  double last_loss = NAN;
  // What the summary reports of the run as it ends (normally or interrupted).
  auto finish_summary = [&] {
    sum.end_step = step_;
    sum.skipped_steps = skipped_;
    sum.final_loss = last_loss;
    sum.tokens_per_s = train_time > 0 ? double(sum.tokens) / train_time : 0.0;
    sum.out_dir = dir;
    sum.weights = path_in(dir, checkpoint::kSingleFile);
    sum.config = path_in(dir, checkpoint::kConfigFile);
    sum.metrics = metrics_path;
  };
  bool have_stage = false;
  DsaStage stage = DsaStage::sparse;
  const Context ctx{true, false};

  int interrupted = 0;
  // A signal reaches the ranks of a job at different moments: they stop at the same step.
  auto pending_signal = [&] {
    if (!opts_.handle_signals) return 0;
    const int64_t own = InterruptGuard::pending();
    if (!opts_.comm || opts_.comm->size() == 1) return int(own);
    // The first rank's signal that is set, on every rank of the job.
    Tensor all = Tensor::zeros({int64_t(opts_.comm->size())}, DType::i64);
    all.data<int64_t>()[opts_.comm->rank()] = own;
    opts_.comm->allreduce_sum(all);
    for (int64_t i = 0; i < all.numel(); ++i)
      if (all.data<int64_t>()[i] != 0) return int(all.data<int64_t>()[i]);
    return 0;
  };
  for (int64_t s = step_ + 1; s <= end; ++s) {
    // A signal during the previous step (or before the first): stop before this one.
    if ((interrupted = pending_signal()) != 0) break;
    const bool dense = cfg_.dsa_dense_warmup_steps < 0 || s <= cfg_.dsa_dense_warmup_steps;
    const DsaStage want = dense ? DsaStage::dense_warmup : DsaStage::sparse;
    if (!have_stage || want != stage) {
      model_->set_dsa_stage(want);
      if (have_stage && cfg_.model.count_layers(LayerKind::dsa) > 0)
        line(fmt::format("step {}: DSA indexer stage -> sparse", s));
      stage = want;
      have_stage = true;
    }
    const Batch global = data_->batch(s);
    // Data parallel over the groups of cp ranks; each group's part split along its tokens.
    const int cp = opts_.context_parallel;
    const Batch batch = dp_ ? shard_batch(global, dp_->rank() / cp, dp_->size() / cp) : global;
    std::optional<dist::CpSlice> slice;
    if (cp > 1)
      slice.emplace(cp_dev_ ? *cp_dev_ : *cp_comm_,
                    SeqLayout::from_tensor(batch.cu_seqlens, batch.num_tokens(), "batch"),
                    dist::CpSlice::even_bounds(batch.num_tokens(), cp));
    const double lr = sched_->at(s);
    const double t0 = now_s();
    const bool on_gpu = opts_.device != Device::cpu;
    if (on_gpu) cuda_reset_peak_memory();
    profile::Scope ps_step("step");
    model_->zero_grad();
    ModelInputs in;
    if (slice) {
      const int64_t b0 = slice->begin(slice->rank()), b1 = slice->end(slice->rank());
      in.tokens = batch.tokens.slice(0, b0, b1).contiguous();
      in.targets = batch.targets.slice(0, b0, b1).contiguous();
      in.cp = &*slice;
      in.cp_mode = opts_.cp_mode;
    } else {
      in.tokens = batch.tokens;
      in.cu_seqlens = batch.cu_seqlens;
      in.targets = batch.targets;
    }
    in.logits = false;  // on CUDA: the head and the loss in chunks (no [T, V] logits held)
    if (dp_) {
      const LossNormalizers nz = global_normalizers(global);
      in.lm_normalizer = nz.lm;
      in.mtp_normalizer = nz.mtp;
      in.aux_sequences = nz.sequences;
    }
    HybridModel::SavedPtr saved;
    profile::Scope ps_fwd("forward");
    ModelOutput out = model_->forward(ctx, in, &saved);
    ps_fwd.end();
    std::vector<double> indexer_scales;
    if (dp_) {
      // The indexer losses average over rows known only now; then every loss is the sum of the
      // ranks' shares.
      std::vector<int64_t> rows = out.indexer_rows;
      dp_->allreduce(rows);
      double indexer = 0;
      for (size_t l = 0; l < rows.size(); ++l) {
        indexer_scales.push_back(rows[l] > 0 ? double(out.indexer_rows[l]) / double(rows[l]) : 0.0);
        indexer += out.indexer_losses[l] * indexer_scales[l];
      }
      std::vector<double> v{out.loss - out.indexer_loss + indexer, out.lm_loss, out.mtp_loss,
                            out.aux_loss, indexer};
      dp_->allreduce(v);
      out.loss = v[0];
      out.lm_loss = v[1];
      out.mtp_loss = v[2];
      out.aux_loss = v[3];
      out.indexer_loss = v[4];
    }
    StepResult r;
    std::string bad;
    if (!std::isfinite(out.loss)) {
      bad = nonfinite_loss_message(out);
    } else {
      profile::Scope ps_bwd("backward");
      model_->backward(ctx, *saved, {}, indexer_scales);
      ps_bwd.end();
      if (opts_.hooks.after_backward) opts_.hooks.after_backward(s, *model_);
      HLM_PROFILE("optimizer");
      // Tensor parallel: the replicated parameters' parts summed first; each rank then updates
      // its parts, and the whole parameters as every other rank does (the same bits).
      if (tp_) tp_reduce_grads(*tp_, *model_, tp_layouts_);
      if (dp_) {
        dp_->reduce_gradients();
        r = opt_->step(lr, tp_ ? tp_grad_norm() : dp_->grad_norm(*opt_));
        if (r.applied) dp_->share_values();
      } else if (tp_) {
        r = opt_->step(lr, tp_grad_norm());
      } else {
        r = opt_->step(lr);
      }
      if (!r.finite || !std::isfinite(r.grad_norm))
        bad = nonfinite_gradient_message(*model_, r.grad_norm);
    }
    saved.reset();
    if (bad.empty()) {
      if (dp_) {
        // The load of the global batch: every layer's counts in one reduction.
        std::vector<int64_t> all;
        for (const Tensor& c : out.expert_counts) {
          const std::vector<int64_t> v = c.to_i64_vector();
          all.insert(all.end(), v.begin(), v.end());
        }
        dp_->allreduce(all);
        size_t at = 0;
        for (Tensor& c : out.expert_counts) {
          const auto n = size_t(c.numel());
          const Tensor h = Tensor::from_vector<int64_t>(
              c.shape(),
              std::vector<int64_t>(all.begin() + ptrdiff_t(at), all.begin() + ptrdiff_t(at + n)));
          c = c.is_cpu() ? h : h.to(c.device());
          at += n;
        }
      }
      model_->update_moe_bias(out.expert_counts);
    }
    ps_step.end();
    const uint64_t peak = on_gpu ? cuda_memory_stats().peak_in_use_bytes : 0;
    sum.peak_device_bytes = std::max(sum.peak_device_bytes, peak);
    const double dt = now_s() - t0;
    train_time += dt;
    interval_time += dt;
    interval_tokens += global.num_tokens();
    sum.tokens += global.num_tokens();
    step_ = s;
    last_loss = out.lm_loss;

    MetricsRecord rec;
    rec.step = s;
    rec.loss = out.lm_loss;
    rec.lr = lr;
    rec.grad_norm = std::isfinite(out.loss) ? r.grad_norm : NAN;  // NaN: no backward ran
    rec.tokens_per_s = interval_time > 0 ? double(interval_tokens) / interval_time : 0.0;
    rec.extra["objective"] = out.loss;
    rec.extra["mtp_loss"] = out.mtp_loss;
    rec.extra["aux_loss"] = out.aux_loss;
    rec.extra["indexer_loss"] = out.indexer_loss;
    rec.extra["skipped_steps"] = double(skipped_);
    if (on_gpu) rec.extra["peak_device_gib"] = double(peak) / double(1ull << 30);

    if (!bad.empty()) {
      if (cfg_.nonfinite == NonfinitePolicy::stop) {
        if (metrics) metrics->write(rec);
        if (bar) bar->finish();
        throw Error(fmt::format(
            "step {}: {}; training stopped (nonfinite = \"stop\"). {}; set nonfinite=skip to "
            "skip such steps, or lower lr",
            s, bad,
            last_ckpt >= 0 ? fmt::format("The last checkpoint (step {}) is in {}", last_ckpt, dir)
                           : fmt::format("No checkpoint was written to {}", dir)));
      }
      ++skipped_;
      rec.extra["skipped_steps"] = double(skipped_);
      line(fmt::format("step {}: {}: step skipped (nonfinite = \"skip\"; {} skipped so far)", s,
                       bad, skipped_));
    }

    const bool is_log = (cfg_.log_interval > 0 && s % cfg_.log_interval == 0) || s == end ||
                        s == sum.start_step + 1;
    // Rank 0 evaluates (the weights are the same everywhere); under expert parallelism every
    // rank runs the evaluation's forward with its expert group.
    // Under tensor parallelism every rank runs it too (the model's sums span the group).
    const bool is_eval = (root_ || groups_ || tp_) &&
                         ((cfg_.eval_interval > 0 && s % cfg_.eval_interval == 0) || s == end);
    if (is_eval) {
      const EvalResult ev = evaluate();
      if (ev.has_accuracy) rec.eval_accuracy = ev.accuracy.value();
      rec.extra["eval_loss"] = ev.loss;
      sum.eval = ev;
      if (ev.has_accuracy)
        line(
            fmt::format("step {}: eval accuracy {:.4f} ({} / {} answers; chance {:.4f}), eval "
                        "loss {:.4f}",
                        s, ev.accuracy.value(), ev.accuracy.correct, ev.accuracy.total,
                        sum.chance_accuracy, ev.loss));
      else
        line(fmt::format("step {}: eval loss {:.4f} ({} targets)", s, ev.loss, ev.targets));
    }
    if (is_log || is_eval || !bad.empty()) {
      if (metrics) metrics->write(rec);
      interval_time = 0;
      interval_tokens = 0;
    }
    if (bar && (bar->is_tty() || is_log))
      bar->update(s, out.lm_loss, train_time > 0 ? double(sum.tokens) / train_time : 0.0);
    if ((cfg_.checkpoint_interval > 0 && s % cfg_.checkpoint_interval == 0) || s == end) {
      save();
      last_ckpt = s;
    }
  }
  if (bar) bar->finish();
  if (!interrupted) interrupted = pending_signal();
  if (last_ckpt != step_) {
    // Interrupted between checkpoints, or stopped before the first step (--stop-after 0).
    save();
    last_ckpt = step_;
  }
  if (interrupted) {
    metrics.reset();
    log(
        fmt::format("interrupted by {} after step {} of {}: the checkpoint of step {} is in {}; "
                    "continue with: hybridlm train --resume {}",
                    signal_name(interrupted), step_, cfg_.steps, step_, dir, dir));
    sum.interrupted_by = interrupted;
    finish_summary();
    sum.wall_s = now_s() - t_start;
    return sum;
  }
  if (end <= sum.start_step) {
    // Nothing to train (resumed at the total): evaluate for the summary.
    if (root_ || groups_ || tp_) sum.eval = evaluate();
    if (opts_.resume)
      log(fmt::format("the checkpoint is already at step {} of {}: nothing to train", step_,
                      cfg_.steps));
    else
      log(
          fmt::format("stopped before step 1 (--stop-after 0): the checkpoint of the initialised "
                      "model (step 0) is in {}",
                      dir));
  }
  metrics.reset();

  finish_summary();
  if (opts_.plot) {
    try {
      sum.plot =
          write_plot(read_metrics(metrics_path), path_in(dir, "metrics"), PlotBackend::automatic,
                     fmt::format("hybridlm train: {}", mqar_ ? "MQAR" : cfg_.data_path));
    } catch (const Error& e) {
      log(fmt::format("warning: no plot: {}", e.what()));
    }
  }
  sum.wall_s = now_s() - t_start;
  if (opts_.print_summary && opts_.log) print_summary(opts_.log, sum, cfg_);
  if (profile::enabled() && opts_.log)
    std::fprintf(opts_.log,
                 "\n== profile (HLM_PROFILE=1: the device synchronised around each scope) ==\n%s",
                 profile::report().c_str());
  return sum;
}

void print_summary(std::FILE* out, const TrainSummary& s, const TrainConfig& cfg) {
  std::string t;
  t += fmt::format("\n== training summary ==\n");
  t += fmt::format(
      "  steps          {} -> {} of {}{}\n", s.start_step, s.end_step, cfg.steps,
      s.skipped_steps ? fmt::format(" ({} skipped: non-finite)", s.skipped_steps) : std::string());
  if (std::isfinite(s.final_loss) || s.end_step > s.start_step)
    t += fmt::format("  final loss     {:.4f} (main cross-entropy of the last step)\n",
                     s.final_loss);
  if (s.eval.has_accuracy) {
    const double ratio = s.chance_accuracy > 0 ? s.eval.accuracy.value() / s.chance_accuracy : 0;
    t += fmt::format(
        "  eval accuracy  {:.4f} on {} held-out MQAR answers (chance {:.4f}: {:.0f}x)\n",
        s.eval.accuracy.value(), s.eval.accuracy.total, s.chance_accuracy, ratio);
  }
  t += fmt::format("  eval loss      {:.4f} over {} targets\n", s.eval.loss, s.eval.targets);
  if (s.processes > 1)
    t += fmt::format("  throughput     {} tokens/s over {} data-parallel processes ({} tokens)\n",
                     format_rate(s.tokens_per_s), s.processes, s.tokens);
  else
    t += fmt::format("  throughput     {} tokens/s ({} tokens trained in this process)\n",
                     format_rate(s.tokens_per_s), s.tokens);
  if (s.peak_device_bytes > 0)
    t += fmt::format("  device memory  {:.2f} GiB at most in use during a step\n",
                     double(s.peak_device_bytes) / double(1ull << 30));
  t += fmt::format("  wall time      {}\n", format_duration(s.wall_s));
  t += fmt::format("  weights        {} (+ {})\n", s.weights, s.config);
  t += fmt::format("  resume state   {}\n", path_in(s.out_dir, kTrainerStateFile));
  t += fmt::format("  metrics        {}\n", s.metrics);
  if (!s.plot.empty()) t += fmt::format("  plot           {}\n", s.plot);
  std::fputs(t.c_str(), out);
  std::fflush(out);
}

}  // namespace hlm::train
