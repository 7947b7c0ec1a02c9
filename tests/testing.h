// Shared test helpers: random inputs, comparisons with a worst-element report, finite differences,
// and the tolerance table (one place for all dtypes).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "core/seq_layout.h"
#include "core/tensor.h"
#include "dist/comm.h"
#include "ops/moe.h"

namespace hlm::testing {

// Fresh random inputs per test: the seed mixes the test name, so every check gets its own data
// but runs are reproducible.
uint64_t test_seed();

// Error metrics of `out` against `ref` (any dtypes, same shape, CPU).
struct ErrorStats {
  double max_abs = 0;  // max |out - ref|
  double max_ulp = 0;  // max |out - ref| / (eps(dtype) * max(|ref|, tiny)) ("units of eps")
  double rel_l2 = 0;   // ||out - ref|| / ||ref||
  int64_t worst = -1;  // flat index of the worst element (by |out - ref|)
  double worst_out = 0, worst_ref = 0;
  int64_t nan_mismatch = 0;  // positions where exactly one of out/ref is NaN or Inf
  std::string report(const Tensor& shape_of) const;
};
ErrorStats compare(const Tensor& out, const Tensor& ref);

struct Tolerance {
  double rel_l2;
  double max_abs;
};
// The tolerance table: what an op computed in `dt` may differ from an FP64 reference.
Tolerance tolerance_for(DType dt);

// Asserts rel_l2 <= tol.rel_l2 and max_abs <= tol.max_abs and no NaN/Inf mismatch; prints the
// worst element and its multi-index on failure.
::testing::AssertionResult close(const Tensor& out, const Tensor& ref, Tolerance tol);
::testing::AssertionResult bit_equal(const Tensor& a, const Tensor& b);

// Central finite differences in FP64: for each element i of `x` (an f64 CPU tensor that `loss`
// reads), d loss / d x_i ~ (loss(x + h e_i) - loss(x - h e_i)) / 2h; compared with `grad`.
// `max_elems` limits the number of probed elements (chosen deterministically, spread out).
::testing::AssertionResult grad_check(const std::function<double()>& loss, Tensor& x,
                                      const Tensor& grad, double h = 1e-6, double tol = 1e-6,
                                      int64_t max_elems = 64);

// sum(a * b) in FP64 (any dtypes, same shape): the usual probe loss for gradient checks.
double dot(const Tensor& a, const Tensor& b);

// Standard normal draws (f64, from `rng`) with every row of the last dimension scaled to unit L2
// norm, then converted to `dt`: realistic q / k inputs for the KDA tests.
Tensor randn_unit_rows(const Shape& shape, DType dt, Rng& rng);

// Runs a shell command (stderr with stdout): its exit status (-1 when it did not exit) and output.
std::pair<int, std::string> run_command(const std::string& command);
// The start of a shell command that runs what follows in n processes under mpirun, oversubscribed
// on this machine's cores: as root (CI) mpirun needs the two OMPI_ALLOW variables, and OpenMPI's
// plugins leak at MPI_Finalize (their frames unloaded before LeakSanitizer reports, with no module
// name to suppress), so the leak check is off in the MPI processes of a sanitizer build. Each
// process gets an equal share of the cores as its OpenMP threads (OMP_NUM_THREADS, at least 1):
// n processes of all-core thread teams on 2 cores ran 5x slower. The results do not depend on it
// (every kernel is thread-count invariant).
std::string mpirun_prefix(int n);
// Whether an `mpirun` is on this machine's PATH (the GPU machines may have none: their tests of
// several processes then skip).
bool mpirun_available();
// Runs `hlm_dist_check ARGS` in n processes (mpirun_prefix) and expects every rank to report its
// checks passed: exit status 0, n "checks passed" lines, no "FAILED". Returns the output.
std::string expect_dist_check(int n, const std::string& args);
// The hlm_dist_check executable: $HLM_DIST_CHECK when set (a build moved to another machine),
// else the one this build made.
std::string dist_check();

// The message of the hlm::Error f() throws, or "(no error)".
std::string error_of(const std::function<void()>& f);

// f() must throw hlm::Error whose message contains `needle`.
void expect_error(const std::function<void()>& f, const std::string& needle);

// cu_seqlens (i64 [N+1], CPU) of a packed batch of sequences of these lengths, and their sum.
Tensor cu_of(const std::vector<int64_t>& lengths);
// The checked layout of the same batch.
SeqLayout seqs_of(const std::vector<int64_t>& lengths);
int64_t total(const std::vector<int64_t>& lengths);

// A packed batch cut into pieces at token offsets `bounds` (0 = b_0 < ... < b_P = T), as context
// parallelism cuts it: piece p holds tokens [b_p, b_{p+1}), its layout the sequences clipped to
// it, and `whole` each clipped sequence's whole length and expert counts (from topk_idx [T, K]
// of E experts), as ops::moe_seq_aux_loss takes them.
struct AuxPiece {
  int64_t begin = 0, end = 0;
  SeqLayout seqs;
  ops::MoeAuxWhole whole;
};
std::vector<AuxPiece> aux_pieces(const SeqLayout& seqs, const Tensor& topk_idx, int64_t E,
                                 const std::vector<int64_t>& bounds);

// A small model config (2 layers, KDA + DSA with KPool, MoE, mHC, MTP; vocab 24): the model.json of
// the command-line tests.
extern const char* const kSmallModelJson;

// While alive, every output an op allocates is NaN-poisoned (ops::set_poison_outputs): an element
// an implementation forgets to write shows up.
struct PoisonOutputs {
  PoisonOutputs();
  ~PoisonOutputs();
  PoisonOutputs(const PoisonOutputs&) = delete;
  PoisonOutputs& operator=(const PoisonOutputs&) = delete;
};

// t rounded to bf16 and back to f32 (CPU): what a CPU reference sees of a GPU op's bf16 input.
Tensor round_bf16(const Tensor& t);

// A group of n ranks seen from rank r, for what reads only rank() and size() (CpSlice's
// constructor, a model's construction under tensor parallelism, the refusals before any
// exchange): every transport call does nothing.
class FakeGroup : public dist::Comm {
 public:
  FakeGroup(int r, int n) : r_(r), n_(n) {}
  int rank() const override { return r_; }
  int size() const override { return n_; }
  const char* backend() const override { return "fake"; }
  void barrier() override {}
  void broadcast_bytes(void*, size_t, int) override {}
  void allgather_bytes(const void*, size_t, void*) override {}
  void alltoall_bytes(const void*, size_t, void*) override {}
  void alltoallv_bytes(const void*, const std::vector<size_t>&, void*,
                       const std::vector<size_t>&) override {}
  void send_bytes(const void*, size_t, int, int) override {}
  void recv_bytes(void*, size_t, int, int) override {}
  std::unique_ptr<dist::Comm> split(int, int) override { return nullptr; }
  void abort_job(int) override {}

 private:
  int r_, n_;
};

// Copies of t on the GPU / the host (an undefined t stays undefined): for the GPU tests.
Tensor gpu(const Tensor& t);
Tensor cpu(const Tensor& t);

}  // namespace hlm::testing
