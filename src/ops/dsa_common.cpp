// Shared plumbing of the DSA ops (ops/dsa_common.h): host-side checks and patterns, used by the
// front doors and by the CPU references.
#include "ops/dsa_common.h"

#include <omp.h>

#include <algorithm>

#include "ops/op_checks.h"

namespace hlm::ops::dsa_detail {

const std::vector<int64_t>& seq_offsets(const SeqLayout& seqs, int64_t T, const char* op) {
  seqs.check_tokens(T, op, "its input");
  return seqs.offsets();
}

QueryWindow whole_window(const std::vector<int64_t>& cu) {
  QueryWindow w;
  w.cu = cu;
  w.q0 = 0;
  w.T = cu.back();
  w.qcu.push_back(0);
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    if (cu[d + 1] == cu[d]) continue;
    w.doc.push_back(int64_t(d));
    w.qcu.push_back(cu[d + 1]);
  }
  return w;
}

QueryWindow window_of(const SeqLayout& seqs, int64_t T, const std::optional<int64_t>& q0,
                      const char* op) {
  if (!q0) return whole_window(seq_offsets(seqs, T, op));
  const std::vector<int64_t>& cu = seqs.offsets();
  HLM_CHECK(*q0 >= 0 && T >= 0 && *q0 + T <= cu.back(),
            "{}: query rows [{}, {}) are not inside the sequence layout's {} tokens", op, *q0,
            *q0 + T, cu.back());
  QueryWindow w;
  w.cu = cu;
  w.q0 = *q0;
  w.T = T;
  w.qcu.push_back(0);
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t lo = std::max(cu[d], w.q0), hi = std::min(cu[d + 1], w.q0 + T);
    if (hi <= lo) continue;
    w.doc.push_back(int64_t(d));
    w.qcu.push_back(hi - w.q0);
  }
  return w;
}

std::vector<int64_t> pool_offsets(const std::vector<int64_t>& cu, int64_t pool) {
  std::vector<int64_t> cp(cu.size(), 0);
  for (size_t i = 1; i < cu.size(); ++i) cp[i] = cp[i - 1] + (cu[i] - cu[i - 1]) / pool;
  return cp;
}

int64_t max_keys_per_doc(const std::vector<int64_t>& cu, int64_t pool) {
  int64_t m = 0;
  for (size_t i = 1; i < cu.size(); ++i) m = std::max(m, (cu[i] - cu[i - 1]) / pool);
  return m;
}

void build_inverse(Pattern& p) {
  const int64_t E = p.entries(), NK = p.nkeys;
  // A stable counting sort of the entries by key. Entries are stored query by query, each row in
  // slot order, so a stable sort keeps each key's list in increasing (t, slot) order. In parallel:
  // the entries are cut into C chunks in order, chunk c counts its keys, and the offsets are laid
  // out key by key and, within a key, chunk by chunk; each chunk then fills its entries in order,
  // which gives exactly the result of one sequential pass.
  const int64_t C = E < (int64_t(1) << 16) ? 1 : std::clamp<int64_t>(omp_get_max_threads(), 1, 64);
  const int64_t per = (E + C - 1) / std::max<int64_t>(C, 1);
  std::vector<int64_t> at(size_t(C * NK), 0);  // [C, NK]: counts, then each chunk's next slot
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c)
    for (int64_t e = c * per; e < std::min(E, (c + 1) * per); ++e)
      ++at[size_t(c * NK + p.key[size_t(e)])];
  p.key_ptr.assign(size_t(NK + 1), 0);
  int64_t run = 0;
  for (int64_t k = 0; k < NK; ++k) {
    p.key_ptr[size_t(k)] = run;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t n = at[size_t(c * NK + k)];
      at[size_t(c * NK + k)] = run;
      run += n;
    }
  }
  p.key_ptr[size_t(NK)] = run;
  p.key_entry.assign(size_t(E), 0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c)
    for (int64_t e = c * per; e < std::min(E, (c + 1) * per); ++e)
      p.key_entry[size_t(at[size_t(c * NK + p.key[size_t(e)])]++)] = e;
}

Pattern causal_pattern(const QueryWindow& w, int64_t pool, int64_t W) {
  Pattern p;
  p.T = w.T;
  p.W = W;
  const std::vector<int64_t> cp = pool_offsets(w.cu, pool);
  p.nkeys = cp.back();
  p.row_ptr.assign(size_t(p.T + 1), 0);
  for (size_t m = 0; m < w.docs(); ++m)
    for (int64_t t = w.qcu[m]; t < w.qcu[m + 1]; ++t)
      p.row_ptr[size_t(t + 1)] = (w.pos(m, t) + 1) / pool;
  for (int64_t t = 0; t < p.T; ++t) p.row_ptr[size_t(t + 1)] += p.row_ptr[size_t(t)];
  const int64_t E = p.row_ptr.back();
  p.slot.resize(size_t(E));
  p.key.resize(size_t(E));
  p.query.resize(size_t(E));
  for (size_t m = 0; m < w.docs(); ++m)
    for (int64_t t = w.qcu[m]; t < w.qcu[m + 1]; ++t) {
      int64_t e = p.row_ptr[size_t(t)];
      const int64_t n = p.row_ptr[size_t(t + 1)] - e;
      for (int64_t j = 0; j < n; ++j, ++e) {
        p.slot[size_t(e)] = int32_t(j);
        p.key[size_t(e)] = cp[size_t(w.doc[m])] + j;
        p.query[size_t(e)] = t;
      }
    }
  build_inverse(p);
  return p;
}

Pattern rows_pattern(const Tensor& rows, const QueryWindow& w, int64_t pool, const char* op,
                     const char* what, bool with_inverse) {
  detail::require_int(rows, op, what);
  const int64_t T = w.T;
  HLM_CHECK(rows.dim() == 2 && rows.size(0) == T, "{}: {} must be [T = {}, W], got {}", op, what, T,
            rows.describe());
  const std::vector<int64_t> v = detail::index_values(rows);
  const std::vector<int64_t> cp = pool_offsets(w.cu, pool);
  Pattern p;
  p.T = T;
  p.W = rows.size(1);
  p.nkeys = cp.back();
  const int64_t W = p.W;
  // Per row, in parallel: the visible keys [lo, hi), the count of entries, and the first problem
  // (bad_j: the first out-of-range column; dup: a repeated key). Rows are independent, and the
  // error thrown is that of the first bad row, as a sequential scan would find it.
  const size_t nrows = static_cast<size_t>(T);
  std::vector<int64_t> lo(nrows), hi(nrows), count(nrows, 0), bad_j(nrows, -1), dup(nrows, -1);
  for (size_t m = 0; m < w.docs(); ++m)
    for (int64_t t = w.qcu[m]; t < w.qcu[m + 1]; ++t) {
      lo[size_t(t)] = cp[size_t(w.doc[m])];
      hi[size_t(t)] = lo[size_t(t)] + (w.pos(m, t) + 1) / pool;
    }
#pragma omp parallel for schedule(dynamic, 64)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* row = v.data() + t * W;
    int64_t n = 0, prev = -1;
    bool ascending = true;
    for (int64_t j = 0; j < W; ++j) {
      const int64_t r = row[j];
      if (r == -1) continue;
      if (r < lo[size_t(t)] || r >= hi[size_t(t)]) {
        bad_j[size_t(t)] = j;
        break;
      }
      ascending = ascending && r > prev;
      prev = r;
      ++n;
    }
    count[size_t(t)] = n;
    if (bad_j[size_t(t)] >= 0 || ascending) continue;  // strictly ascending: no repeats
    thread_local std::vector<int64_t> seen;
    seen.clear();
    for (int64_t j = 0; j < W; ++j)
      if (row[j] != -1) seen.push_back(row[j]);
    std::sort(seen.begin(), seen.end());
    const auto it = std::adjacent_find(seen.begin(), seen.end());
    if (it != seen.end()) dup[size_t(t)] = *it;
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t j = bad_j[size_t(t)];
    HLM_CHECK(j < 0,
              "{}: {}[{}, {}] = {} is not a causal {} of query {}'s document (expected -1 or "
              "a value in [{}, {}))",
              op, what, t, j, v[size_t(t * W + std::max<int64_t>(j, 0))],
              pool == 1 ? "token" : "pool", w.q0 + t, lo[size_t(t)], hi[size_t(t)]);
    HLM_CHECK(dup[size_t(t)] < 0, "{}: {} row {} holds index {} more than once", op, what, t,
              dup[size_t(t)]);
  }
  p.row_ptr.assign(size_t(T + 1), 0);
  for (int64_t t = 0; t < T; ++t)
    p.row_ptr[size_t(t + 1)] = p.row_ptr[size_t(t)] + count[size_t(t)];
  const int64_t E = p.row_ptr.back();
  p.slot.resize(size_t(E));
  p.key.resize(size_t(E));
  p.query.resize(size_t(E));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    int64_t e = p.row_ptr[size_t(t)];
    for (int64_t j = 0; j < W; ++j) {
      const int64_t r = v[size_t(t * W + j)];
      if (r == -1) continue;
      p.slot[size_t(e)] = int32_t(j);
      p.key[size_t(e)] = r;
      p.query[size_t(e)] = t;
      ++e;
    }
  }
  if (with_inverse) build_inverse(p);
  return p;
}

void check_pattern(Pattern& p, int64_t nkeys, const char* op, const char* what) {
  const int64_t E = p.entries();
  HLM_CHECK(p.T >= 0 && p.W >= 0 && int64_t(p.row_ptr.size()) == p.T + 1 && p.row_ptr[0] == 0 &&
                p.row_ptr.back() == E && int64_t(p.key.size()) == E &&
                int64_t(p.slot.size()) == E && int64_t(p.query.size()) == E,
            "{}: {} is not a pattern of {} queries and {} entries", op, what, p.T, E);
  for (int64_t t = 0; t < p.T; ++t) {
    HLM_CHECK(p.row_ptr[size_t(t)] <= p.row_ptr[size_t(t + 1)],
              "{}: {}: the entries of query {} end before they start", op, what, t);
    for (int64_t e = p.row_ptr[size_t(t)]; e < p.row_ptr[size_t(t + 1)]; ++e)
      HLM_CHECK(p.query[size_t(e)] == t && p.slot[size_t(e)] >= 0 && p.slot[size_t(e)] < p.W &&
                    p.key[size_t(e)] >= 0 && p.key[size_t(e)] < nkeys,
                "{}: {}: entry {} of query {} (slot {}, row {}) is outside [0, {}) x [0, {})", op,
                what, e, t, p.slot[size_t(e)], p.key[size_t(e)], p.W, nkeys);
  }
  p.nkeys = nkeys;
}

PageTable page_table(const std::vector<const std::vector<int64_t>*>& pages) {
  PageTable t;
  for (const auto* p : pages) t.max_pages = std::max(t.max_pages, int64_t(p->size()));
  t.flat.assign(pages.size() * size_t(t.max_pages), 0);
  for (size_t n = 0; n < pages.size(); ++n)
    std::copy(pages[n]->begin(), pages[n]->end(), t.flat.begin() + int64_t(n) * t.max_pages);
  return t;
}

}  // namespace hlm::ops::dsa_detail
