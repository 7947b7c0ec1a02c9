// `hybridlm serve`: an OpenAI-compatible completions server over the Generator's continuous
// batching (docs/inference.md, "hybridlm serve"), on cpp-httplib.
//
//   hybridlm serve --model DIR [--host 127.0.0.1] [--port 8000] [--max-batch 16]
//                  [--cache-tokens 65536] [--dtype f32|f64] [--device cpu|cuda] [--speculative]
// --port 0 takes a free port; the line "serve: listening on http://HOST:PORT" on stdout names it.
//
// POST /v1/completions, a JSON object:
//   prompt          a string (needs the checkpoint's tokenizer.json) or an array of token ids
//   max_tokens      tokens to generate at most (default 16)
//   temperature     default 1 (0: greedy); top_p (default 1); top_k (default 0: off); seed
//                   (default 0: a request's tokens depend on its seed, not on other requests)
//   stop_token_ids  token ids that end the answer (the config's eos_token_id when absent)
//   logprobs        0 or 1: return each generated token's log-probability under the model
//   prompt_logprobs true: also the prompt tokens' (after the first)
//   stream          true: server-sent events, one per token, then "data: [DONE]"
//   n               1 only; stop strings are not supported (stop_token_ids instead)
// The answer: {"id", "object": "text_completion", "created", "model", "choices": [{"index": 0,
// "text", "token_ids", "logprobs": {"tokens", "token_logprobs"} or null, "prompt_logprobs",
// "finish_reason": "stop" | "length"}], "usage": {"prompt_tokens", "completion_tokens",
// "total_tokens"}}. A bad request gets HTTP 400 and {"error": {"message", "type":
// "invalid_request_error"}} (a body over 64 MiB: 413); other requests are unaffected. GET /health
// answers 200 "ok".
// --speculative drafts with the checkpoint's MTP block (its weights are read); every request must
// then be greedy (temperature 0: a sampled one gets HTTP 400), and its answer is plain greedy
// decoding's.
// Requests run concurrently: one engine thread steps the Generator, admitting requests as the
// cache allows; an HTTP thread per connection waits for its request's tokens.
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/infer_load.h"
#include "core/memory.h"
#include "infer/generator.h"
#include "model/checkpoint.h"
#include "model/config_limits.h"
#include "model/hybrid_model.h"
#include "tokenizer/tokenizer.h"

namespace hlm::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct ServeArgs {
  std::string model, host = "127.0.0.1", dtype = "f32", device = "cpu";
  int64_t port = 8000, max_batch = 16, cache_tokens = 65536;
  bool speculative = false;
};

// What an HTTP thread and the engine thread share about one request.
struct Channel {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<infer::TokenEvent> events;
  bool done = false;
  std::atomic<bool> gone{false};  // the client disconnected
  std::string error;              // the engine failed on it
  infer::Result result;
};

class Engine {
 public:
  Engine(const HybridModel& model, const CacheOptions& co) : gen_(model, co) {
    thread_ = std::thread([this] { loop(); });
  }
  ~Engine() { stop(); }
  // Ends the engine thread (idempotent); the generator's counters are then safe to read.
  void stop() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  // After stop(): speculative decoding's drafts checked and accepted.
  std::pair<int64_t, int64_t> drafts() const { return {gen_.drafts(), gen_.accepted()}; }
  // hlm::Error for a bad request (nothing queued).
  std::shared_ptr<Channel> submit(infer::Request r) {
    std::lock_guard<std::mutex> l(mu_);
    gen_.check(r);
    auto ch = std::make_shared<Channel>();
    pending_.emplace_back(std::move(r), ch);
    cv_.notify_all();
    return ch;
  }

 private:
  void loop() {
    for (;;) {
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || !pending_.empty() || gen_.busy(); });
        if (stop_) return;
        for (auto& [r, ch] : pending_) channels_[gen_.submit(std::move(r))] = ch;
        pending_.clear();
      }
      // Requests whose client went away are dropped.
      for (auto it = channels_.begin(); it != channels_.end();) {
        if (it->second->gone) {
          gen_.cancel(it->first);
          it = channels_.erase(it);
        } else {
          ++it;
        }
      }
      std::vector<infer::TokenEvent> ev;
      try {
        ev = gen_.step();
      } catch (const std::exception& e) {
        // Not expected (requests are checked and admitted within the budget): end every request
        // in flight with the error rather than the process.
        for (auto& [id, ch] : channels_) finish(*ch, e.what());
        channels_.clear();
        gen_.cancel_all();
        continue;
      }
      for (const infer::TokenEvent& e : ev) {
        const std::shared_ptr<Channel> chp = channels_.at(e.id);
        Channel& ch = *chp;
        std::lock_guard<std::mutex> l(ch.mu);
        if (e.token >= 0) ch.events.push_back(e);
        if (e.last) {
          ch.result = gen_.take(e.id);
          ch.done = true;
          channels_.erase(e.id);
        }
        ch.cv.notify_all();
      }
    }
  }
  static void finish(Channel& ch, const std::string& err) {
    std::lock_guard<std::mutex> l(ch.mu);
    ch.error = err;
    ch.done = true;
    ch.cv.notify_all();
  }

  infer::Generator gen_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<std::pair<infer::Request, std::shared_ptr<Channel>>> pending_;
  std::map<int64_t, std::shared_ptr<Channel>> channels_;  // engine thread only
  std::thread thread_;
};

struct BadRequest : std::runtime_error {
  using std::runtime_error::runtime_error;
};

json error_body(const std::string& msg) {
  return {{"error", {{"message", msg}, {"type", "invalid_request_error"}}}};
}

// The request's fields, checked (BadRequest naming the field).
struct Parsed {
  infer::Request req;
  bool stream = false, logprobs = false;
};

Parsed parse_request(const std::string& body, const ModelConfig& cfg,
                     const tokenizer::Tokenizer* tok) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    throw BadRequest(fmt::format("the body is not JSON: {}", e.what()));
  }
  if (!j.is_object()) throw BadRequest("the body must be a JSON object");
  static const std::set<std::string> known = {
      "model",          "prompt",   "max_tokens",      "temperature", "top_p", "top_k",
      "seed",           "logprobs", "prompt_logprobs", "stream",      "n",     "stop",
      "stop_token_ids", "user"};
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!known.count(it.key())) throw BadRequest(fmt::format("unknown field '{}'", it.key()));
  auto number = [&](const char* k, double lo, double hi, double def) {
    if (!j.contains(k) || j[k].is_null()) return def;
    if (!j[k].is_number()) throw BadRequest(fmt::format("'{}' must be a number", k));
    const double v = j[k].get<double>();
    if (!(v >= lo && v <= hi)) throw BadRequest(fmt::format("'{}' must be in [{}, {}]", k, lo, hi));
    return v;
  };
  auto integer = [&](const char* k, int64_t lo, int64_t hi, int64_t def) {
    if (!j.contains(k) || j[k].is_null()) return def;
    if (!j[k].is_number_integer()) throw BadRequest(fmt::format("'{}' must be an integer", k));
    const int64_t v = j[k].get<int64_t>();
    if (v < lo || v > hi) throw BadRequest(fmt::format("'{}' must be in [{}, {}]", k, lo, hi));
    return v;
  };
  auto boolean = [&](const char* k) {
    if (!j.contains(k) || j[k].is_null()) return false;
    if (!j[k].is_boolean()) throw BadRequest(fmt::format("'{}' must be true or false", k));
    return j[k].get<bool>();
  };
  Parsed p;
  if (!j.contains("prompt")) throw BadRequest("'prompt' is missing");
  const json& pr = j["prompt"];
  if (pr.is_string()) {
    if (!tok) throw BadRequest("a text prompt needs the model's tokenizer.json; send token ids");
    for (uint32_t id : tok->encode(pr.get<std::string>())) p.req.prompt.push_back(int64_t(id));
  } else if (pr.is_array()) {
    for (const json& v : pr) {
      if (!v.is_number_integer())
        throw BadRequest("'prompt' must be a string or an array of token ids");
      p.req.prompt.push_back(v.get<int64_t>());
    }
  } else {
    throw BadRequest("'prompt' must be a string or an array of token ids");
  }
  p.req.max_new = integer("max_tokens", 0, int64_t(1) << 30, 16);
  p.req.sampling.temperature = number("temperature", 0, 1e6, 1.0);
  p.req.sampling.top_p = number("top_p", 1e-300, 1, 1.0);
  p.req.sampling.top_k = integer("top_k", 0, int64_t(1) << 40, 0);
  p.req.sampling.seed = uint64_t(integer("seed", 0, INT64_MAX, 0));
  if (integer("n", 1, 1, 1) != 1) throw BadRequest("'n' must be 1");
  if (j.contains("stop") && !j["stop"].is_null() && !(j["stop"].is_array() && j["stop"].empty()))
    throw BadRequest("stop strings are not supported; give 'stop_token_ids'");
  if (j.contains("stop_token_ids") && !j["stop_token_ids"].is_null()) {
    if (!j["stop_token_ids"].is_array())
      throw BadRequest("'stop_token_ids' must be an array of token ids");
    for (const json& v : j["stop_token_ids"]) {
      if (!v.is_number_integer()) throw BadRequest("'stop_token_ids' must hold token ids");
      p.req.stop.push_back(v.get<int64_t>());
    }
  } else {
    p.req.stop = cfg.eos_token_ids;
  }
  p.logprobs = integer("logprobs", 0, 1, 0) == 1;
  p.req.prompt_logprobs = boolean("prompt_logprobs");
  p.stream = boolean("stream");
  return p;
}

std::string piece(const tokenizer::Tokenizer* tok, int64_t id) {
  return tok ? tok->decode(std::vector<uint32_t>{uint32_t(id)}) : std::string();
}

httplib::Server* g_server = nullptr;
void on_signal(int) {
  if (g_server) g_server->stop();
}

void run_serve(const ServeArgs& a) {
  const ModelConfig cfg = ModelConfig::load(a.model);
  const Device dev = inference_device(a.device, a.dtype, cfg, "serve");
  HLM_CHECK(!a.speculative || cfg.mtp.num_layers >= 1,
            "serve --speculative: the model has no MTP block to draft with "
            "(num_nextn_predict_layers = 0)");
  HybridModelOptions opt;
  opt.dtype = a.dtype == "f64" ? DType::f64 : DType::f32;
  opt.mtp = a.speculative;
  CacheOptions co;
  co.max_seqs = a.max_batch;
  co.max_tokens = a.cache_tokens;
  co.speculative = a.speculative;
  co.device = dev;  // on CUDA the latents are bf16 unless the MLA projections are native
  const CacheBytes cb = ModelCache::plan(cfg, compute_dtype(opt.dtype), co);
  checkpoint::LoadOptions lo;
  if (!a.speculative) lo.ignore_layers_from = cfg.num_hidden_layers;
  lo.allow_missing = cfg.tie_word_embeddings;
  Workload w;
  w.tokens = std::min<int64_t>(a.cache_tokens, cfg.max_position_embeddings);
  w.dtype = opt.dtype;
  w.mtp = a.speculative;
  w.bf16_gemm_weights = true;  // load_inference_model keeps them in bf16
  check_inference_memory(cfg, w, cb.total(), "serve");
  const std::unique_ptr<tokenizer::Tokenizer> tok = tokenizer_if_any(a.model);
  const std::unique_ptr<HybridModel> model =
      load_inference_model(a.model, cfg, opt, lo, dev, "serve");
  Engine engine(*model, co);
  const std::string name = fs::path(a.model).filename().string();
  std::atomic<int64_t> serial{0};

  httplib::Server svr;
  // A request body is a prompt and a few settings: 64 MiB is far more than a prompt the cache
  // holds, and keeps a hostile body from taking the memory.
  svr.set_payload_max_length(size_t(64) << 20);
  svr.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok", "text/plain");
  });
  svr.Post("/v1/completions", [&](const httplib::Request& hreq, httplib::Response& res) {
    Parsed p;
    std::shared_ptr<Channel> ch;
    try {
      p = parse_request(hreq.body, cfg, tok.get());
      ch = engine.submit(p.req);
    } catch (const BadRequest& e) {
      res.status = 400;
      res.set_content(error_body(e.what()).dump(), "application/json");
      return;
    } catch (const Error& e) {
      res.status = 400;
      res.set_content(error_body(e.what()).dump(), "application/json");
      return;
    }
    const std::string id = fmt::format("cmpl-{}", serial++);
    const int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count();
    const int64_t prompt_tokens = int64_t(p.req.prompt.size());
    if (p.stream) {
      res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          "text/event-stream", [ch, p, id, created, name, &tok](size_t, httplib::DataSink& sink) {
            std::unique_lock<std::mutex> l(ch->mu);
            ch->cv.wait(l, [&] { return !ch->events.empty() || ch->done; });
            while (!ch->events.empty()) {
              const infer::TokenEvent e = ch->events.front();
              ch->events.pop_front();
              json c = {{"index", 0},
                        {"text", piece(tok.get(), e.token)},
                        {"token_ids", {e.token}},
                        {"logprobs", p.logprobs ? json{{"tokens", {piece(tok.get(), e.token)}},
                                                       {"token_logprobs", {e.logprob}}}
                                                : json(nullptr)},
                        {"finish_reason", nullptr}};
              if (e.last) c["finish_reason"] = ch->result.finish;
              const json chunk = {{"id", id},
                                  {"object", "text_completion"},
                                  {"created", created},
                                  {"model", name},
                                  {"choices", {c}}};
              const std::string s = "data: " + chunk.dump() + "\n\n";
              if (!sink.write(s.data(), s.size())) {
                ch->gone = true;
                return false;
              }
            }
            if (ch->done) {
              if (!ch->error.empty()) {
                const std::string s = "data: " + error_body(ch->error).dump() + "\n\n";
                sink.write(s.data(), s.size());
              }
              const std::string s = "data: [DONE]\n\n";
              sink.write(s.data(), s.size());
              sink.done();
            }
            return true;
          });
      return;
    }
    {
      std::unique_lock<std::mutex> l(ch->mu);
      ch->cv.wait(l, [&] { return ch->done; });
    }
    if (!ch->error.empty()) {
      res.status = 500;
      res.set_content(json{{"error", {{"message", ch->error}, {"type", "server_error"}}}}.dump(),
                      "application/json");
      return;
    }
    const infer::Result& r = ch->result;
    std::string text;
    if (tok) {
      std::vector<uint32_t> ids;
      for (int64_t t : r.tokens) ids.push_back(uint32_t(t));
      text = tok->decode(ids);
    }
    json lp = nullptr;
    if (p.logprobs) {
      json toks = json::array();
      for (int64_t t : r.tokens) toks.push_back(piece(tok.get(), t));
      lp = {{"tokens", toks}, {"token_logprobs", r.logprobs}};
    }
    json choice = {{"index", 0},
                   {"text", text},
                   {"token_ids", r.tokens},
                   {"logprobs", lp},
                   {"finish_reason", r.finish}};
    if (p.req.prompt_logprobs) choice["prompt_logprobs"] = r.prompt_logprobs;
    const json out = {{"id", id},
                      {"object", "text_completion"},
                      {"created", created},
                      {"model", name},
                      {"choices", {choice}},
                      {"usage",
                       {{"prompt_tokens", prompt_tokens},
                        {"completion_tokens", int64_t(r.tokens.size())},
                        {"total_tokens", prompt_tokens + int64_t(r.tokens.size())}}}};
    res.set_content(out.dump(), "application/json");
  });
  svr.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string msg = "internal error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          msg = e.what();
        }
        res.status = 500;
        res.set_content(json{{"error", {{"message", msg}, {"type", "server_error"}}}}.dump(),
                        "application/json");
      });

  int port = int(a.port);
  if (a.port == 0) {
    port = svr.bind_to_any_port(a.host);
    HLM_CHECK(port > 0, "serve: cannot bind a port on {}", a.host);
  } else {
    HLM_CHECK(svr.bind_to_port(a.host, port), "serve: cannot listen on {}:{} (in use?)", a.host,
              port);
  }
  g_server = &svr;
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::printf("serve: listening on http://%s:%d (cache %s: %lld sequences, %lld tokens)\n",
              a.host.c_str(), port, format_bytes(double(cb.total())).c_str(),
              (long long)co.max_seqs, (long long)(cb.num_pages * cb.page_tokens));
  std::fflush(stdout);
  svr.listen_after_bind();
  engine.stop();
  if (a.speculative)
    std::fprintf(stderr, "serve: MTP drafts accepted %lld of %lld\n",
                 (long long)engine.drafts().second, (long long)engine.drafts().first);
  g_server = nullptr;
  std::printf("serve: stopped\n");
}

std::function<void()> setup_serve(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  app.add_option("--model", a->model, "checkpoint directory (config.json + safetensors)")
      ->required();
  app.add_option("--host", a->host, "address to listen on (default 127.0.0.1)");
  app.add_option("--port", a->port, "port (default 8000; 0: any free port)")
      ->check(count_range(0, 65535));
  app.add_option("--max-batch", a->max_batch, "sequences generated together at most (16)")
      ->check(count_range(1, 4096));
  app.add_option("--cache-tokens", a->cache_tokens,
                 "tokens the cache holds over all sequences (65536)")
      ->check(count_range(1, int64_t(1) << 34));
  app.add_option("--dtype", a->dtype, "compute dtype")->check(CLI::IsMember({"f32", "f64"}));
  app.add_option("--device", a->device, "cpu or cuda: where the model and its cache run")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--speculative", a->speculative,
               "draft with the MTP block (requests greedy only: temperature 0)");
  return [a] { run_serve(*a); };
}

}  // namespace

HLM_REGISTER_COMMAND("serve",
                     "an OpenAI-compatible completions server (CPU or CUDA, continuous batching)",
                     setup_serve);

}  // namespace hlm::cli
