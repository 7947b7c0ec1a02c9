#include "train/interrupt.h"

#include <signal.h>

#include <atomic>

#include "core/error.h"

namespace hlm::train {

namespace {

std::atomic<int> g_pending{0};
std::atomic<bool> g_active{false};
struct sigaction g_old_int, g_old_term;

extern "C" void on_signal(int sig) {
  int expected = 0;
  if (g_pending.compare_exchange_strong(expected, sig)) return;
  // The second signal: the default action, now (signal() and raise() are async-signal-safe).
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

}  // namespace

InterruptGuard::InterruptGuard() {
  HLM_CHECK(!g_active.exchange(true), "InterruptGuard: only one guard may live at a time");
  g_pending = 0;
  struct sigaction sa = {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, &g_old_int);
  ::sigaction(SIGTERM, &sa, &g_old_term);
}

InterruptGuard::~InterruptGuard() {
  ::sigaction(SIGINT, &g_old_int, nullptr);
  ::sigaction(SIGTERM, &g_old_term, nullptr);
  g_active = false;
}

int InterruptGuard::pending() {
  return g_pending.load();
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    default:
      return "a signal";
  }
}

}  // namespace hlm::train
