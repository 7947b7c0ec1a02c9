// kda_chunk: the chunked WY form of KDA (docs/kda.md, "The chunked algorithm"), forward and
// backward, CPU.
//
// Each stage below is one OpenMP loop over (chunk, value head) or (sequence, value head) that
// writes only its own slice of a global buffer, as one CUDA kernel would (deterministic, no
// reductions across tasks). Per chunk of L <= C tokens (rows r, s = 0..L-1 from the chunk start),
// with the state S at chunk start, G the chunk-local cumsum of g, Gam = exp(G), and
// E_rs = exp(G_r - G_s) (formed per element for r >= s only: never exp(-G) alone):
//   A_qk[r,s] = scale sum_d q_rd k_sd E_rsd  (r >= s)      A_kk[r,s] = beta_r sum_d k_rd k_sd E_rsd
//   (r > s) Minv = (I + A_kk)^-1 (forward substitution) W = Minv (beta Gam k),  U = Minv (beta v)
//   V_new = U - W S,  O = scale (q Gam) S + A_qk V_new,  S' = Diag(Gam_L) S + (k exp(G_L - G))^T
//   V_new
// Backward (hand-derived; dS' is the gradient w.r.t. the state at chunk end):
//   dA_qk = tril(dO V_new^T);  dV_new = A_qk^T dO + kg dS'
//   dS = Diag(Gam_L) dS' + scale (q Gam)^T dO - W^T dV_new                  (reverse state pass)
//   dq = Gam scale dO S^T;  dk = e (V_new dS'^T);  dW = -dV_new S^T;  dU = dV_new
//   dKB = Minv^T dW, dVB = Minv^T dU;  dA_kk = -stril(dKB W^T + dVB U^T)
//   dv = beta dVB;  dbeta = v.dVB + (Gam k).dKB;  dk += beta Gam dKB
//   dG: q dq_inter - k dk_write + (on the last row) sum_r k dk_write + Gam_L rowsum(S dS')
//       + beta Gam k dKB; intra terms t = dA E-weighted products: dG_r += t, dG_s -= t
//   dg = reverse cumsum of dG within the chunk.
#include <cmath>
#include <vector>

#include "ops/cpu/kda.h"

namespace hlm::ops::cpu {
namespace {

constexpr int64_t C = kKdaChunk;

struct Chunk {
  int64_t n, bos, len;  // sequence, first token, length (1..C)
};

// The plain parameter block every stage reads. Row strides: qk arrays H*K, per value head arrays
// HV*K / HV*V / HV*C; chunk-state arrays [NC, HV, K, V].
template <class T>
struct Params {
  int64_t T_, H, HV, K, V, N, Gq, NC;
  T scale;
  bool par;  // worth running the stages on several threads
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_chunk;    // [N+1]: chunks of sequence n are first_chunk[n] .. [n+1]-1
  const T *q, *k, *v, *g, *beta, *h0;  // [T,H,K] x2, [T,HV,V], [T,HV,K], [T,HV], [N,HV,K,V]
  // forward buffers
  T *G, *Aqk, *Akk, *Minv, *W, *U, *h, *Vnew, *ht;  // [T,HV,K] [T,HV,C]x3 [T,HV,K] [T,HV,V]
                                                    // [NC,HV,K,V] [T,HV,V] [N,HV,K,V]
  // pointer helpers
  const T* qr(int64_t t, int64_t hv) const { return q + (t * H + hv / Gq) * K; }
  const T* kr(int64_t t, int64_t hv) const { return k + (t * H + hv / Gq) * K; }
  int64_t rk(int64_t t, int64_t hv) const { return (t * HV + hv) * K; }
  int64_t rv(int64_t t, int64_t hv) const { return (t * HV + hv) * V; }
  int64_t rc(int64_t t, int64_t hv) const { return (t * HV + hv) * C; }
  int64_t st(int64_t ci, int64_t hv) const { return (ci * HV + hv) * K * V; }
};

template <class T>
struct Buffers {
  Tensor G, Aqk, Akk, Minv, W, U, h, Vnew, ht;
};

// ht: the final state's buffer [N, HV, K, V] (undefined: a new one).
template <class T>
Params<T> make_params(const KdaDims& d, const kda_detail::Prepared& p, const Tensor& v,
                      const Tensor& ht, Buffers<T>& b) {
  Params<T> P;
  P.T_ = d.T, P.H = d.H, P.HV = d.HV, P.K = d.K, P.V = d.V, P.N = d.N, P.Gq = d.HV / d.H;
  P.scale = T(d.scale);
  P.par = d.T * d.HV * d.K * std::max(d.V, C) >= (int64_t(1) << 17);
  P.first_chunk.push_back(0);
  for (int64_t n = 0; n < d.N; ++n) {
    for (int64_t s = d.cu[n]; s < d.cu[n + 1]; s += C)
      P.chunks.push_back({n, s, std::min(C, d.cu[n + 1] - s)});
    P.first_chunk.push_back(int64_t(P.chunks.size()));
  }
  P.NC = int64_t(P.chunks.size());
  P.q = p.q.data<T>(), P.k = p.k.data<T>(), P.v = v.data<T>(), P.g = p.g.data<T>();
  P.beta = p.beta.data<T>(), P.h0 = p.h0.data<T>();
  const DType dt = dtype_of<T>::value;
  const int64_t Tn = d.T, HV = d.HV;
  b.G = Tensor::empty({Tn, HV, d.K}, dt);
  b.Aqk = Tensor::empty({Tn, HV, C}, dt);
  b.Akk = Tensor::empty({Tn, HV, C}, dt);
  b.Minv = Tensor::empty({Tn, HV, C}, dt);
  b.W = Tensor::empty({Tn, HV, d.K}, dt);
  b.U = Tensor::empty({Tn, HV, d.V}, dt);
  b.h = Tensor::empty({P.NC, HV, d.K, d.V}, dt);
  b.Vnew = Tensor::empty({Tn, HV, d.V}, dt);
  b.ht = ht.defined() ? ht : Tensor::empty({d.N, HV, d.K, d.V}, dt);
  P.G = b.G.template data<T>(), P.Aqk = b.Aqk.template data<T>(), P.Akk = b.Akk.template data<T>();
  P.Minv = b.Minv.template data<T>(), P.W = b.W.template data<T>(), P.U = b.U.template data<T>();
  P.h = b.h.template data<T>(), P.Vnew = b.Vnew.template data<T>(), P.ht = b.ht.template data<T>();
  return P;
}

// ---------------------------------------------------------------- forward stages

// Stage 1: G = chunk-local inclusive cumsum of g.
template <class T>
void stage_gate_cumsum(const Params<T>& P) {
#pragma omp parallel for collapse(2) schedule(static) if (P.par)
  for (int64_t ci = 0; ci < P.NC; ++ci)
    for (int64_t h = 0; h < P.HV; ++h) {
      const Chunk c = P.chunks[size_t(ci)];
      for (int64_t r = 0; r < c.len; ++r) {
        const T* gr = P.g + P.rk(c.bos + r, h);
        T* Gr = P.G + P.rk(c.bos + r, h);
        const T* Gp = r ? P.G + P.rk(c.bos + r - 1, h) : nullptr;
        for (int64_t d = 0; d < P.K; ++d) Gr[d] = (Gp ? Gp[d] : T(0)) + gr[d];
      }
    }
}

// Stage 2: A_qk (scale included, diagonal included) and A_kk (strictly lower, beta_r included).
template <class T>
void stage_intra(const Params<T>& P) {
#pragma omp parallel for collapse(2) schedule(static) if (P.par)
  for (int64_t ci = 0; ci < P.NC; ++ci)
    for (int64_t h = 0; h < P.HV; ++h) {
      const Chunk c = P.chunks[size_t(ci)];
      std::vector<T> e(static_cast<size_t>(P.K));
      for (int64_t r = 0; r < c.len; ++r) {
        const int64_t tr = c.bos + r;
        const T *qr = P.qr(tr, h), *kr = P.kr(tr, h), *Gr = P.G + P.rk(tr, h);
        T *aq = P.Aqk + P.rc(tr, h), *ak = P.Akk + P.rc(tr, h);
        const T br = P.beta[tr * P.HV + h];
        for (int64_t s = 0; s <= r; ++s) {
          const int64_t ts = c.bos + s;
          const T *ks = P.kr(ts, h), *Gs = P.G + P.rk(ts, h);
          T sq = 0, sk = 0;
          for (int64_t d = 0; d < P.K; ++d) e[size_t(d)] = std::exp(Gr[d] - Gs[d]);  // r >= s
          for (int64_t d = 0; d < P.K; ++d) {
            const T ke = ks[d] * e[size_t(d)];
            sq += qr[d] * ke;
            sk += kr[d] * ke;
          }
          aq[s] = P.scale * sq;
          ak[s] = s < r ? br * sk : T(0);
        }
        for (int64_t s = r + 1; s < C; ++s) aq[s] = ak[s] = 0;
      }
    }
}

// Stage 3: Minv = (I + A_kk)^-1 by forward substitution; W = Minv (beta Gam k); U = Minv (beta v).
template <class T>
void stage_wy(const Params<T>& P) {
#pragma omp parallel for collapse(2) schedule(static) if (P.par)
  for (int64_t ci = 0; ci < P.NC; ++ci)
    for (int64_t h = 0; h < P.HV; ++h) {
      const Chunk c = P.chunks[size_t(ci)];
      for (int64_t r = 0; r < c.len; ++r) {
        const int64_t tr = c.bos + r;
        const T* ar = P.Akk + P.rc(tr, h);
        T* mr = P.Minv + P.rc(tr, h);
        for (int64_t j = 0; j < C; ++j) mr[j] = 0;
        mr[r] = 1;
        for (int64_t i = 0; i < r; ++i) {  // row r = e_r - sum_{i<r} A[r,i] Minv[i,:]
          const T a = ar[i];
          const T* mi = P.Minv + P.rc(c.bos + i, h);
          for (int64_t j = 0; j <= i; ++j) mr[j] -= a * mi[j];
        }
        T *Wr = P.W + P.rk(tr, h), *Ur = P.U + P.rv(tr, h);
        for (int64_t d = 0; d < P.K; ++d) Wr[d] = 0;
        for (int64_t j = 0; j < P.V; ++j) Ur[j] = 0;
        for (int64_t s = 0; s <= r; ++s) {
          const int64_t ts = c.bos + s;
          const T m = mr[s] * P.beta[ts * P.HV + h];
          const T *ks = P.kr(ts, h), *Gs = P.G + P.rk(ts, h), *vs = P.v + P.rv(ts, h);
          for (int64_t d = 0; d < P.K; ++d) Wr[d] += m * std::exp(Gs[d]) * ks[d];
          for (int64_t j = 0; j < P.V; ++j) Ur[j] += m * vs[j];
        }
      }
    }
}

// Stage 4: sequential over the chunks of a sequence: h[c] = S, V_new = U - W S,
// S <- Diag(Gam_L) S + (k exp(G_L - G))^T V_new. Writes the final state.
template <class T>
void stage_state_fwd(const Params<T>& P) {
  const int64_t K = P.K, V = P.V;
#pragma omp parallel for collapse(2) schedule(dynamic) if (P.par)
  for (int64_t n = 0; n < P.N; ++n)
    for (int64_t h = 0; h < P.HV; ++h) {
      T* S = P.ht + (n * P.HV + h) * K * V;
      std::copy(P.h0 + (n * P.HV + h) * K * V, P.h0 + (n * P.HV + h + 1) * K * V, S);
      for (int64_t ci = P.first_chunk[size_t(n)]; ci < P.first_chunk[size_t(n) + 1]; ++ci) {
        const Chunk c = P.chunks[size_t(ci)];
        std::copy(S, S + K * V, P.h + P.st(ci, h));
        for (int64_t r = 0; r < c.len; ++r) {
          const int64_t tr = c.bos + r;
          const T* Wr = P.W + P.rk(tr, h);
          T* vn = P.Vnew + P.rv(tr, h);
          std::copy(P.U + P.rv(tr, h), P.U + P.rv(tr, h) + V, vn);
          for (int64_t d = 0; d < K; ++d) {
            const T w = Wr[d];
            for (int64_t j = 0; j < V; ++j) vn[j] -= w * S[d * V + j];
          }
        }
        const T* GL = P.G + P.rk(c.bos + c.len - 1, h);
        for (int64_t d = 0; d < K; ++d) {
          const T a = std::exp(GL[d]);
          for (int64_t j = 0; j < V; ++j) S[d * V + j] *= a;
        }
        for (int64_t r = 0; r < c.len; ++r) {
          const int64_t tr = c.bos + r;
          const T *kr = P.kr(tr, h), *Gr = P.G + P.rk(tr, h), *vn = P.Vnew + P.rv(tr, h);
          for (int64_t d = 0; d < K; ++d) {
            const T w = kr[d] * std::exp(GL[d] - Gr[d]);
            for (int64_t j = 0; j < V; ++j) S[d * V + j] += w * vn[j];
          }
        }
      }
    }
}

// Stage 5: O = scale (q Gam) h[c] + A_qk V_new.
template <class T>
void stage_output(const Params<T>& P, T* O) {
  const int64_t K = P.K, V = P.V;
#pragma omp parallel for collapse(2) schedule(static) if (P.par)
  for (int64_t ci = 0; ci < P.NC; ++ci)
    for (int64_t h = 0; h < P.HV; ++h) {
      const Chunk c = P.chunks[size_t(ci)];
      const T* S = P.h + P.st(ci, h);
      for (int64_t r = 0; r < c.len; ++r) {
        const int64_t tr = c.bos + r;
        const T *qr = P.qr(tr, h), *Gr = P.G + P.rk(tr, h), *aq = P.Aqk + P.rc(tr, h);
        T* o = O + P.rv(tr, h);
        for (int64_t j = 0; j < V; ++j) o[j] = 0;
        for (int64_t d = 0; d < K; ++d) {
          const T w = P.scale * qr[d] * std::exp(Gr[d]);
          for (int64_t j = 0; j < V; ++j) o[j] += w * S[d * V + j];
        }
        for (int64_t s = 0; s <= r; ++s) {
          const T a = aq[s];
          const T* vn = P.Vnew + P.rv(c.bos + s, h);
          for (int64_t j = 0; j < V; ++j) o[j] += a * vn[j];
        }
      }
    }
}

template <class T>
void forward_stages(const Params<T>& P) {
  stage_gate_cumsum(P);
  stage_intra(P);
  stage_wy(P);
  stage_state_fwd(P);
}

// ---------------------------------------------------------------- backward stages

template <class T>
struct BwdParams {
  const T* dO;    // [T,HV,V]
  const T* dht;   // [N,HV,K,V]
  T* dAqk;        // [T,HV,C]  gradient w.r.t. the stored A_qk (scale included)
  T* dAkk;        // [T,HV,C]
  T* dVnew;       // [T,HV,V]
  T* dh;          // [NC,HV,K,V] gradient w.r.t. the state at the END of chunk c
  T* dh0;         // [N,HV,K,V]
  T *dq, *dk;     // [T,HV,K] per value head
  T *dv, *dbeta;  // [T,HV,V], [T,HV]
  T* dG;          // [T,HV,K] gradient w.r.t. G; then dg in place (reverse cumsum)
};

// Stage B2: dA_qk = tril_incl(dO V_new^T); dV_new = A_qk^T dO.
template <class T>
void stage_dav(const Params<T>& P, const BwdParams<T>& B) {
  const int64_t V = P.V;
#pragma omp parallel for collapse(2) schedule(static) if (P.par)
  for (int64_t ci = 0; ci < P.NC; ++ci)
    for (int64_t h = 0; h < P.HV; ++h) {
      const Chunk c = P.chunks[size_t(ci)];
      for (int64_t r = 0; r < c.len; ++r) {
        const int64_t tr = c.bos + r;
        const T* dor = B.dO + P.rv(tr, h);
        T* da = B.dAqk + P.rc(tr, h);
        for (int64_t s = 0; s < C; ++s) {
          T acc = 0;
          if (s <= r) {
            const T* vn = P.Vnew + P.rv(c.bos + s, h);
            for (int64_t j = 0; j < V; ++j) acc += dor[j] * vn[j];
          }
          da[s] = acc;
        }
      }
      for (int64_t s = 0; s < c.len; ++s) {
        T* dv = B.dVnew + P.rv(c.bos + s, h);
        for (int64_t j = 0; j < V; ++j) dv[j] = 0;
        for (int64_t r = s; r < c.len; ++r) {
          const T a = P.Aqk[P.rc(c.bos + r, h) + s];
          const T* dor = B.dO + P.rv(c.bos + r, h);
          for (int64_t j = 0; j < V; ++j) dv[j] += a * dor[j];
        }
      }
    }
}

// Stage B3: reverse state pass. dS starts at dht; per chunk from the last: dh[c] = dS;
// dV_new += kg dS; dS <- Diag(Gam_L) dS + scale (q Gam)^T dO - W^T dV_new. Ends with dh0.
template <class T>
void stage_state_bwd(const Params<T>& P, const BwdParams<T>& B) {
  const int64_t K = P.K, V = P.V;
#pragma omp parallel for collapse(2) schedule(dynamic) if (P.par)
  for (int64_t n = 0; n < P.N; ++n)
    for (int64_t h = 0; h < P.HV; ++h) {
      T* dS = B.dh0 + (n * P.HV + h) * K * V;
      std::copy(B.dht + (n * P.HV + h) * K * V, B.dht + (n * P.HV + h + 1) * K * V, dS);
      for (int64_t ci = P.first_chunk[size_t(n) + 1] - 1; ci >= P.first_chunk[size_t(n)]; --ci) {
        const Chunk c = P.chunks[size_t(ci)];
        std::copy(dS, dS + K * V, B.dh + P.st(ci, h));
        const T* GL = P.G + P.rk(c.bos + c.len - 1, h);
        for (int64_t r = 0; r < c.len; ++r) {
          const int64_t tr = c.bos + r;
          const T *kr = P.kr(tr, h), *Gr = P.G + P.rk(tr, h);
          T* dvn = B.dVnew + P.rv(tr, h);
          for (int64_t d = 0; d < K; ++d) {
            const T w = kr[d] * std::exp(GL[d] - Gr[d]);
            for (int64_t j = 0; j < V; ++j) dvn[j] += w * dS[d * V + j];
          }
        }
        for (int64_t d = 0; d < K; ++d) {
          const T a = std::exp(GL[d]);
          for (int64_t j = 0; j < V; ++j) dS[d * V + j] *= a;
        }
        for (int64_t r = 0; r < c.len; ++r) {
          const int64_t tr = c.bos + r;
          const T *qr = P.qr(tr, h), *Gr = P.G + P.rk(tr, h), *Wr = P.W + P.rk(tr, h);
          const T *dor = B.dO + P.rv(tr, h), *dvn = B.dVnew + P.rv(tr, h);
          for (int64_t d = 0; d < K; ++d) {
            const T wq = P.scale * qr[d] * std::exp(Gr[d]), ww = Wr[d];
            for (int64_t j = 0; j < V; ++j) dS[d * V + j] += wq * dor[j] - ww * dvn[j];
          }
        }
      }
    }
}

// Stage B4: per chunk, the inter-chunk dq, the write-term dk, the state-decay dg, and the WY
// backward (dW, dU -> dKB, dVB -> dA_kk, dv, dbeta, dk, dG).
template <class T>
void stage_wy_bwd(const Params<T>& P, const BwdParams<T>& B) {
  const int64_t K = P.K, V = P.V;
#pragma omp parallel for collapse(2) schedule(static) if (P.par)
  for (int64_t ci = 0; ci < P.NC; ++ci)
    for (int64_t h = 0; h < P.HV; ++h) {
      const Chunk c = P.chunks[size_t(ci)];
      const int64_t L = c.len;
      const T *S = P.h + P.st(ci, h), *dS = B.dh + P.st(ci, h);
      const T* GL = P.G + P.rk(c.bos + L - 1, h);
      std::vector<T> dW(size_t(L * K)), dKB(size_t(L * K), T(0)), dVB(size_t(L * V), T(0)),
          dGL(size_t(K), T(0));
      for (int64_t r = 0; r < L; ++r) {
        const int64_t tr = c.bos + r;
        const T *qr = P.qr(tr, h), *kr = P.kr(tr, h), *Gr = P.G + P.rk(tr, h);
        const T *dor = B.dO + P.rv(tr, h), *vn = P.Vnew + P.rv(tr, h), *dvn = B.dVnew + P.rv(tr, h);
        T *dq = B.dq + P.rk(tr, h), *dk = B.dk + P.rk(tr, h), *dG = B.dG + P.rk(tr, h);
        for (int64_t d = 0; d < K; ++d) {
          T a = 0, b = 0, w = 0;
          for (int64_t j = 0; j < V; ++j) {
            a += dor[j] * S[d * V + j];
            b += vn[j] * dS[d * V + j];
            w += dvn[j] * S[d * V + j];
          }
          const T dqd = P.scale * std::exp(Gr[d]) * a;
          const T dkd = std::exp(GL[d] - Gr[d]) * b;
          dq[d] = dqd;
          dk[d] = dkd;
          dG[d] = qr[d] * dqd - kr[d] * dkd;
          dGL[size_t(d)] += kr[d] * dkd;
          dW[size_t(r * K + d)] = -w;
        }
      }
      for (int64_t d = 0; d < K; ++d) {
        T s = 0;
        for (int64_t j = 0; j < V; ++j) s += S[d * V + j] * dS[d * V + j];
        dGL[size_t(d)] += std::exp(GL[d]) * s;
      }
      // dKB = Minv^T dW, dVB = Minv^T dV_new (dU = dV_new)
      for (int64_t r = 0; r < L; ++r) {
        const T* mr = P.Minv + P.rc(c.bos + r, h);
        const T* dvn = B.dVnew + P.rv(c.bos + r, h);
        for (int64_t s = 0; s <= r; ++s) {
          const T m = mr[s];
          for (int64_t d = 0; d < K; ++d) dKB[size_t(s * K + d)] += m * dW[size_t(r * K + d)];
          for (int64_t j = 0; j < V; ++j) dVB[size_t(s * V + j)] += m * dvn[j];
        }
      }
      // dA_kk[r,s] = -(dKB_r . W_s + dVB_r . U_s), s < r
      for (int64_t r = 0; r < L; ++r) {
        T* da = B.dAkk + P.rc(c.bos + r, h);
        for (int64_t s = 0; s < C; ++s) {
          T acc = 0;
          if (s < r) {
            const T *Ws = P.W + P.rk(c.bos + s, h), *Us = P.U + P.rv(c.bos + s, h);
            for (int64_t d = 0; d < K; ++d) acc += dKB[size_t(r * K + d)] * Ws[d];
            for (int64_t j = 0; j < V; ++j) acc += dVB[size_t(r * V + j)] * Us[j];
          }
          da[s] = -acc;
        }
      }
      // KB = beta Gam k, VB = beta v
      for (int64_t s = 0; s < L; ++s) {
        const int64_t ts = c.bos + s;
        const T bs = P.beta[ts * P.HV + h];
        const T *ks = P.kr(ts, h), *Gs = P.G + P.rk(ts, h), *vs = P.v + P.rv(ts, h);
        T *dk = B.dk + P.rk(ts, h), *dG = B.dG + P.rk(ts, h), *dv = B.dv + P.rv(ts, h);
        T db = 0;
        for (int64_t j = 0; j < V; ++j) {
          dv[j] = bs * dVB[size_t(s * V + j)];
          db += vs[j] * dVB[size_t(s * V + j)];
        }
        for (int64_t d = 0; d < K; ++d) {
          const T gk = std::exp(Gs[d]) * ks[d] * dKB[size_t(s * K + d)];
          db += gk;
          dk[d] += bs * std::exp(Gs[d]) * dKB[size_t(s * K + d)];
          dG[d] += bs * gk;
        }
        B.dbeta[ts * P.HV + h] = db;
      }
      T* dGl = B.dG + P.rk(c.bos + L - 1, h);
      for (int64_t d = 0; d < K; ++d) dGl[d] += dGL[size_t(d)];
    }
}

// Stage B5: intra backward from dA_qk and dA_kk (E_rs formed per element for s <= r only).
template <class T>
void stage_intra_bwd(const Params<T>& P, const BwdParams<T>& B) {
  const int64_t K = P.K;
#pragma omp parallel for collapse(2) schedule(static) if (P.par)
  for (int64_t ci = 0; ci < P.NC; ++ci)
    for (int64_t h = 0; h < P.HV; ++h) {
      const Chunk c = P.chunks[size_t(ci)];
      std::vector<T> e(static_cast<size_t>(K));
      for (int64_t r = 0; r < c.len; ++r) {
        const int64_t tr = c.bos + r;
        const T *qr = P.qr(tr, h), *kr = P.kr(tr, h), *Gr = P.G + P.rk(tr, h);
        const T *daq = B.dAqk + P.rc(tr, h), *dak = B.dAkk + P.rc(tr, h);
        const T br = P.beta[tr * P.HV + h];
        T *dqr = B.dq + P.rk(tr, h), *dkr = B.dk + P.rk(tr, h), *dGr = B.dG + P.rk(tr, h);
        T dbr = 0;
        for (int64_t s = 0; s <= r; ++s) {
          const int64_t ts = c.bos + s;
          const T *ks = P.kr(ts, h), *Gs = P.G + P.rk(ts, h);
          T *dks = B.dk + P.rk(ts, h), *dGs = B.dG + P.rk(ts, h);
          const T a = P.scale * daq[s];
          const T b = s < r ? dak[s] : T(0);
          const T bb = b * br;
          for (int64_t d = 0; d < K; ++d) e[size_t(d)] = std::exp(Gr[d] - Gs[d]);
          T kk = 0;
          for (int64_t d = 0; d < K; ++d) {
            const T E = e[size_t(d)];
            const T ksE = ks[d] * E;
            kk += kr[d] * ksE;
            dqr[d] += a * ksE;
            dks[d] += (a * qr[d] + bb * kr[d]) * E;
            dkr[d] += bb * ksE;
            const T t = (a * qr[d] + bb * kr[d]) * ksE;
            dGr[d] += t;
            dGs[d] -= t;
          }
          dbr += b * kk;
        }
        B.dbeta[tr * P.HV + h] += dbr;
      }
    }
}

// Stage B6: dg = reverse cumsum of dG within each chunk (in place).
template <class T>
void stage_reverse_cumsum(const Params<T>& P, const BwdParams<T>& B) {
#pragma omp parallel for collapse(2) schedule(static) if (P.par)
  for (int64_t ci = 0; ci < P.NC; ++ci)
    for (int64_t h = 0; h < P.HV; ++h) {
      const Chunk c = P.chunks[size_t(ci)];
      for (int64_t r = c.len - 2; r >= 0; --r) {
        T* a = B.dG + P.rk(c.bos + r, h);
        const T* b = B.dG + P.rk(c.bos + r + 1, h);
        for (int64_t d = 0; d < P.K; ++d) a[d] += b[d];
      }
    }
}

template <class T>
void chunk_fwd(const KdaArgs& a, const KdaDims& d, Tensor& o, Tensor& final_state) {
  const DType dt = dtype_of<T>::value;
  const kda_detail::Prepared pr = kda_detail::prepare(a, d, dt);
  Tensor v = a.v.to(dt);
  Buffers<T> buf;
  Params<T> P = make_params<T>(d, pr, v, final_state, buf);
  forward_stages(P);
  stage_output(P, o.data<T>());
}

template <class T>
void chunk_bwd(const KdaArgs& a, const KdaDims& d, const Tensor& d_o, const Tensor& d_final,
               KdaGrads& r) {
  const DType dt = dtype_of<T>::value;
  const kda_detail::Prepared pr = kda_detail::prepare(a, d, dt);
  Tensor v = a.v.to(dt);
  Buffers<T> buf;
  Params<T> P = make_params<T>(d, pr, v, Tensor(), buf);
  forward_stages(P);  // stage B1: recompute G, A, Minv, W, U, h, V_new
  Tensor doc = d_o.to(dt);
  Tensor dhtc = d_final.defined() ? d_final.to(dt) : Tensor::zeros({d.N, d.HV, d.K, d.V}, dt);
  Tensor dAqk = Tensor::empty({d.T, d.HV, C}, dt), dAkk = Tensor::empty({d.T, d.HV, C}, dt);
  Tensor dVnew = Tensor::empty({d.T, d.HV, d.V}, dt),
         dh = Tensor::empty({P.NC, d.HV, d.K, d.V}, dt);
  Tensor dqv = Tensor::empty({d.T, d.HV, d.K}, dt), dkv = Tensor::empty({d.T, d.HV, d.K}, dt);
  BwdParams<T> B{doc.data<T>(),
                 dhtc.data<T>(),
                 dAqk.data<T>(),
                 dAkk.data<T>(),
                 dVnew.data<T>(),
                 dh.data<T>(),
                 r.dinitial_state.data<T>(),
                 dqv.data<T>(),
                 dkv.data<T>(),
                 r.dv.data<T>(),
                 r.dbeta.data<T>(),
                 r.dg.data<T>()};
  stage_dav(P, B);
  stage_state_bwd(P, B);
  stage_wy_bwd(P, B);
  stage_intra_bwd(P, B);
  stage_reverse_cumsum(P, B);
  // GVA: sum the value heads of each qk head in a fixed order.
  r.dq.zero_();
  r.dk.zero_();
  T *rq = r.dq.data<T>(), *rk = r.dk.data<T>();
  const T *dq = dqv.data<T>(), *dk = dkv.data<T>();
  const int64_t Gq = d.HV / d.H;
#pragma omp parallel for schedule(static) if (P.par)
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t h = 0; h < d.HV; ++h)
      for (int64_t i = 0; i < d.K; ++i) {
        rq[(t * d.H + h / Gq) * d.K + i] += dq[(t * d.HV + h) * d.K + i];
        rk[(t * d.H + h / Gq) * d.K + i] += dk[(t * d.HV + h) * d.K + i];
      }
  kda_detail::finish_grads(a, d, pr, r);
}

}  // namespace

void kda_chunk_forward(const KdaArgs& a, const KdaDims& d, Tensor& o, Tensor& final_state) {
  if (o.dtype() == DType::f64)
    chunk_fwd<double>(a, d, o, final_state);
  else
    chunk_fwd<float>(a, d, o, final_state);
}

void kda_chunk_backward(const KdaArgs& a, const KdaDims& d, const Tensor& d_o,
                        const Tensor& d_final_state, KdaGrads& g) {
  if (g.dv.dtype() == DType::f64)
    chunk_bwd<double>(a, d, d_o, d_final_state, g);
  else
    chunk_bwd<float>(a, d, d_o, d_final_state, g);
}

}  // namespace hlm::ops::cpu
