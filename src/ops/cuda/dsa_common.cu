// Device copies of the DSA ops' host-built patterns and layouts (ops/cuda/dsa_common.cuh).
#include "ops/cuda/dsa_common.cuh"
#include "ops/cuda/layer_ops_common.cuh"

namespace hlm::ops::cuda {

DsaPatternDev upload_pattern(const dsa_detail::Pattern& p, bool with_inverse) {
  DsaPatternDev d;
  d.T = p.T, d.W = p.W, d.nkeys = p.nkeys, d.entries = p.entries();
  d.row_ptr = to_device(p.row_ptr);
  d.slot = to_device(p.slot);
  d.key = to_device(p.key);
  d.query = to_device(p.query);
  if (with_inverse) {
    d.key_ptr = to_device(p.key_ptr);
    d.key_entry = to_device(p.key_entry);
  }
  return d;
}

DsaLayoutDev upload_layout(const std::vector<int64_t>& cu, int64_t P) {
  DsaLayoutDev d;
  d.T = cu.back(), d.P = P;
  const std::vector<int64_t> cp = dsa_detail::pool_offsets(cu, P);
  d.nkeys = cp.back();
  std::vector<int64_t> start(size_t(d.T)), end(size_t(d.T)), base(size_t(d.T));
  for (size_t i = 0; i + 1 < cu.size(); ++i)
    for (int64_t t = cu[i]; t < cu[i + 1]; ++t) {
      start[size_t(t)] = cu[i];
      end[size_t(t)] = cu[i + 1];
      base[size_t(t)] = cp[i];
    }
  d.doc_start = to_device(start);
  d.doc_end = to_device(end);
  d.key_base = to_device(base);
  return d;
}

}  // namespace hlm::ops::cuda
