# Chunked KDA on the GPU: our CUDA kernels (libhlm_kda_bench.so, bench/kda_chunk_capi.cpp) and FLA's
# chunk_kda (the anchor of bench/RESULTS.md, "Anchors and targets") in one process, on the same
# input tensors, timed by the same timer: the median of triton.testing.do_bench (which flushes the
# L2 cache before every call). FLA comes from the PyPI wheels fla-core / flash-linear-attention
# carried to the device (never committed).
#
# Usage: python3 bench/kda_chunk_bench.py --lib BUILD/bench/libhlm_kda_bench.so [--no-fla]
#        [--rows 1,2,...] [--rep MS] [--tf32-stages M1,M2,...] [--no-saved]
# Forward + backward rows time ours three times: "ours" recomputes the forward intermediates in
# the backward (the least memory), "ours-k" has the forward keep A_qk and M^-1
# (KdaChunkCudaBuffers::kept, 512 bytes per token and head, as FLA keeps its A_qk and A_kk) and the
# backward recompute the rest, "ours-s" has the forward save all of them
# (KdaChunkCudaBuffers::saved, ~5.5 KiB per token and head) and the backward skip its recompute;
# all must give the same bits ("same bits" / "DIFFERENT BITS" on the ours-k and ours-s lines).
# --no-saved skips ours-k and ours-s.
# --tf32-stages: time ours once per mask of the stages whose bf16 products run in plain TF32
# (HLM_KDA_TF32_STAGES, read by kda_chunk_capi.cpp; the stage bits: KdaStage in
# src/ops/cuda/kda_chunk/heuristics.h), and print every tensor's error and a digest of the output
# bits (to check that a change keeps them).
#
# Rows (bench/RESULTS.md, "Anchors and targets"): K = V = 128, bf16 inputs, packed sequences of
# equal length, zero initial state, the final state written; the backward starts from a random d o
# (no final-state gradient). "plain": g is a precomputed log decay lower_bound * sigmoid(x) in
# [-5, 0) (FLA: safe_gate=True, lower_bound=-5); q, k L2-normalised beforehand; beta = sigmoid(x).
# "fused": raw q, k with the in-kernel L2 norm, beta logits with the in-kernel sigmoid and the raw
# gate input with the lower-bound gate (A_log, dt_bias) computed inside the kernels.
#
# Reported per row: ms, M tokens/s, TFLOP/s and GB/s of the models below, the fraction of the
# roofline max(FLOP / 790 TFLOP/s, bytes / 4.3 TB/s) / time, and speed-up = FLA ms / our ms
# (> 1: ours is faster). Accuracy: relative L2 distance of o (and of every gradient) from our
# FP32 path on the same bf16-rounded inputs (which matches the FP64 CPU reference to ~3e-7), for
# ours and for FLA.
#
# FLOP model, per token and value head, chunk C = 64 (matrix products counted in full, 2 FLOP per
# multiply-add): A_qk and A_kk 4 C K, W = M^-1 (beta Gam k) 2 C K, U = M^-1 (beta v) 2 C V,
# A_qk V_new 2 C V, the three state products (W S, qg S, kg^T V_new) 6 K V, the triangular
# inverse C^2 / 3. K = V = 128: 181.6 kFLOP. Forward + backward: 3x the forward.
# Byte model (the least traffic): forward reads q, k, v, g, beta and writes o and the final state;
# the backward reads them and d o again and writes dq, dk, dv, dg, dbeta.
import argparse
import ctypes
import hashlib
import os
import sys
import time

import torch
import triton

PEAK_FLOPS = 790e12
PEAK_BYTES = 4.3e12
C = 64

ROWS = [  # (id, T, HV, sequences, pass, kind)
    (1, 8192, 32, 1, "fwd", "plain"),
    (2, 8192, 32, 1, "fwd+bwd", "plain"),
    (3, 32768, 64, 8, "fwd", "plain"),
    (4, 32768, 64, 8, "fwd+bwd", "plain"),
    (5, 65536, 64, 16, "fwd+bwd", "plain"),
    (6, 32768, 64, 8, "fwd", "fused"),
    (7, 32768, 64, 8, "fwd+bwd", "fused"),
]


class Problem(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in
                ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0", "cu_seqlens_host", "d_o",
                 "d_ht")] + \
               [(n, ctypes.c_int64) for n in ("T", "H", "HV", "K", "V", "N")] + \
               [(n, ctypes.c_int32) for n in ("dtype", "gate", "use_qk_l2norm", "beta_logits")] + \
               [("lower_bound", ctypes.c_double), ("scale", ctypes.c_double)]


class Ours:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.hlm_kda_create.restype = ctypes.c_void_p
        self.lib.hlm_kda_create.argtypes = [ctypes.POINTER(Problem)]
        self.lib.hlm_kda_last_error.restype = ctypes.c_char_p
        for f in ("hlm_kda_forward", "hlm_kda_forward_backward", "hlm_kda_destroy"):
            getattr(self.lib, f).argtypes = [ctypes.c_void_p]
        self.lib.hlm_kda_set_save.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.lib.hlm_kda_fetch.argtypes = [ctypes.c_void_p] * 9
        self.has_backward = bool(self.lib.hlm_kda_has_backward())

    def check(self, rc):
        if rc != 0:
            raise RuntimeError(self.lib.hlm_kda_last_error().decode())

    def create(self, x, dtype_code):
        ptr = lambda t: None if t is None else t.data_ptr()
        cu_host = x["cu"].cpu().contiguous()
        p = Problem(q=ptr(x["q"]), k=ptr(x["k"]), v=ptr(x["v"]), g=ptr(x["g"]),
                    beta=ptr(x["beta"]), A_log=ptr(x.get("A_log")),
                    dt_bias=ptr(x.get("dt_bias")), h0=None, cu_seqlens_host=cu_host.data_ptr(),
                    d_o=ptr(x["do"]), d_ht=None, T=x["T"], H=x["H"], HV=x["HV"], K=x["K"],
                    V=x["V"], N=x["N"], dtype=dtype_code, gate=1 if x["fused"] else 0,
                    use_qk_l2norm=int(x["fused"]), beta_logits=int(x["fused"]),
                    lower_bound=-5.0, scale=0.0)
        h = self.lib.hlm_kda_create(ctypes.byref(p))
        if not h:
            raise RuntimeError(self.lib.hlm_kda_last_error().decode())
        return h

    def results(self, h, x, dt, grads):
        T, H, HV, K, V, N = (x[n] for n in ("T", "H", "HV", "K", "V", "N"))
        dev = "cuda"
        o = torch.empty(T, HV, V, device=dev, dtype=dt)
        ht = torch.empty(N, HV, K, V, device=dev, dtype=torch.float32)
        out = {"o": o, "ht": ht}
        ptrs = [None] * 6
        if grads:
            f32 = torch.float32  # our backward returns f32 gradients (FLA: the input dtype)
            out.update(dq=torch.empty(T, H, K, device=dev, dtype=f32),
                       dk=torch.empty(T, H, K, device=dev, dtype=f32),
                       dv=torch.empty(T, HV, V, device=dev, dtype=f32),
                       dg=torch.empty(T, HV, K, device=dev, dtype=f32),
                       dbeta=torch.empty(T, HV, device=dev, dtype=f32))
            ptrs = [out[n].data_ptr() for n in ("dq", "dk", "dv", "dg", "dbeta")] + [None]
        self.check(self.lib.hlm_kda_fetch(h, o.data_ptr(), ht.data_ptr(), *ptrs))
        return out


def make_inputs(T, HV, N, fused, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    H, K, V = HV, 128, 128
    dev, bf = "cuda", torch.bfloat16
    rn = lambda *s: torch.randn(*s, device=dev, dtype=torch.float32, generator=g)
    q, k = rn(T, H, K), rn(T, H, K)
    if not fused:
        q = torch.nn.functional.normalize(q, dim=-1)
        k = torch.nn.functional.normalize(k, dim=-1)
    x = {"T": T, "H": H, "HV": HV, "K": K, "V": V, "N": N, "fused": fused,
         "q": q.to(bf), "k": k.to(bf), "v": rn(T, HV, V).to(bf), "do": rn(T, HV, V).to(bf),
         "cu": torch.arange(0, T + 1, T // N, device=dev, dtype=torch.long)}
    if fused:
        x["g"] = rn(T, HV, K).to(bf)  # raw gate input z
        x["beta"] = rn(T, HV).to(bf)  # logits
        x["A_log"] = torch.log(torch.empty(HV, device=dev).uniform_(1, 16, generator=g))
        x["dt_bias"] = 0.5 * rn(HV * K)
    else:
        x["g"] = (-5.0 * torch.sigmoid(rn(T, HV, K))).to(bf)
        x["beta"] = torch.sigmoid(rn(T, HV)).to(bf)
    return x


def fla_call(chunk_kda, x, grads):
    ins = {n: x[n].detach().clone().requires_grad_(grads) for n in ("q", "k", "v", "g", "beta")}
    kw = dict(output_final_state=True, cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu"].cpu(),
              safe_gate=True, lower_bound=-5.0)
    if x["fused"]:
        kw.update(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
    args = [ins[n].unsqueeze(0) for n in ("q", "k", "v", "g", "beta")]

    def run():
        o, ht = chunk_kda(*args, **kw)
        if grads:
            torch.autograd.backward(o, x["do"].unsqueeze(0))
        return o, ht

    def results():
        for t in ins.values():
            t.grad = None
        o, ht = run()
        r = {"o": o[0].detach(), "ht": ht.detach()}
        if grads:
            r.update({"d" + n: ins[n].grad for n in ("q", "k", "v", "g", "beta")})
        return r

    return run, results


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def models(T, HV, N, K, V, passes, in_bytes):
    fwd_flop = T * HV * (4 * C * K + 2 * C * K + 2 * C * V + 2 * C * V + 6 * K * V + C * C / 3)
    io_fwd = T * HV * (2 * K + V + K + 1) * in_bytes + T * HV * V * in_bytes + N * HV * K * V * 4
    io_bwd = T * HV * (2 * K + V + K + 1 + V) * in_bytes + T * HV * (2 * K + V + K + 1) * in_bytes
    if passes == "fwd":
        return fwd_flop, io_fwd
    return 3 * fwd_flop, io_fwd + io_bwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--rows", default="")
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms)")
    ap.add_argument("--tf32-stages", default="", help="comma-separated stage masks")
    ap.add_argument("--no-saved", action="store_true", help="fwd+bwd: skip the saved mode")
    args = ap.parse_args()
    ours = Ours(args.lib)
    chunk_kda = None
    if not args.no_fla:
        from fla.ops.kda import chunk_kda
    want = {int(r) for r in args.rows.split(",") if r}
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
          f"{triton.__version__}  our backward: {'yes' if ours.has_backward else 'no'}")
    hdr = (f"{'row':>3} {'T':>6} {'H':>3} {'N':>3} {'kind':>5} {'pass':>8} | {'impl':>6} "
           f"{'ms':>8} {'Mtok/s':>7} {'TFLOP/s':>8} {'GB/s':>7} {'roof':>6} | {'speed-up':>8} | "
           f"{'err o':>8} {'err grads (max)':>15}")
    print(hdr)
    for rid, T, HV, N, passes, kind in ROWS:
        if want and rid not in want:
            continue
        grads = passes == "fwd+bwd"
        if grads and not ours.has_backward and chunk_kda is None:
            continue
        x = make_inputs(T, HV, N, kind == "fused", seed=rid)
        flop, nbytes = models(T, HV, N, 128, 128, passes, 2)
        line = lambda impl, ms: (f"{rid:>3} {T:>6} {HV:>3} {N:>3} {kind:>5} {passes:>8} | "
                                 f"{impl:>6} {ms:>8.3f} {T / ms / 1e3:>7.2f} "
                                 f"{flop / ms / 1e9:>8.1f} {nbytes / ms / 1e6:>7.0f} "
                                 f"{max(flop / PEAK_FLOPS, nbytes / PEAK_BYTES) * 1e3 / ms:>6.1%}")
        # Reference: our FP32 path on the same (bf16-rounded) values.
        ref = None
        x32 = dict(x)
        for n in ("q", "k", "v", "g", "beta", "do"):
            x32[n] = x[n].float().contiguous()
        h32 = ours.create(x32, 0)
        ms_ours = ms_saved = ms_kept = None
        res_ours = None
        if not grads or ours.has_backward:
            fn = ours.lib.hlm_kda_forward_backward if grads else ours.lib.hlm_kda_forward
            ours.check(fn(h32))
            ref = ours.results(h32, x32, torch.float32, grads)
            ours.lib.hlm_kda_destroy(h32)
            h32 = None
            h = ours.create(x, 1)
            for mask in [m for m in args.tf32_stages.split(",") if m]:
                os.environ["HLM_KDA_TF32_STAGES"] = mask
                ours.check(fn(h))
                r = ours.results(h, x, torch.bfloat16, grads)
                ms = triton.testing.do_bench(lambda: ours.check(fn(h)), warmup=25, rep=args.rep,
                                             return_mode="median")
                e = " ".join(f"{n} {rel(r[n], ref[n]):.2e}" for n in
                             ("o", "ht", "dq", "dk", "dv", "dg", "dbeta") if n in r and n in ref)
                digest = hashlib.sha256()
                for n in sorted(r):
                    digest.update(r[n].contiguous().view(torch.uint8).cpu().numpy().tobytes())
                print(f"{rid:>3} tf32 stages {mask:>5}: {ms:8.3f} ms | {e} | bits "
                      f"{digest.hexdigest()[:16]}")
                sys.stdout.flush()
            os.environ.pop("HLM_KDA_TF32_STAGES", None)
            ours.check(fn(h))
            res_ours = ours.results(h, x, torch.bfloat16, grads)
            ms_ours = triton.testing.do_bench(lambda: ours.check(fn(h)), warmup=25,
                                              rep=args.rep, return_mode="median")
            if grads and not args.no_saved:
                for mode in (2, 1):
                    ours.check(ours.lib.hlm_kda_set_save(h, mode))
                    ours.check(fn(h))
                    res_m = ours.results(h, x, torch.bfloat16, grads)
                    ms_m = triton.testing.do_bench(lambda: ours.check(fn(h)), warmup=25,
                                                   rep=args.rep, return_mode="median")
                    same_m = all(torch.equal(res_m[n], res_ours[n]) for n in res_ours)
                    del res_m
                    if mode == 2:
                        ms_kept, same_kept = ms_m, same_m
                    else:
                        ms_saved, same_saved = ms_m, same_m
            ours.lib.hlm_kda_destroy(h)
        else:
            ours.check(ours.lib.hlm_kda_forward(h32))
            ref = ours.results(h32, x32, torch.float32, False)
        if h32 is not None:
            ours.lib.hlm_kda_destroy(h32)

        def errs(r):
            e_o = rel(r["o"], ref["o"])
            e_g = max((rel(r[n], ref[n]) for n in ("dq", "dk", "dv", "dg", "dbeta") if n in ref
                       and n in r), default=float("nan"))
            return f"{e_o:>8.2e} {e_g:>15.2e}"

        ms_fla = None
        if chunk_kda is not None:
            run, results = fla_call(chunk_kda, x, grads)
            t0 = time.time()
            run()
            torch.cuda.synchronize()
            first = time.time() - t0
            ms_fla = triton.testing.do_bench(run, warmup=25, rep=args.rep, return_mode="median")
            res_fla = results()
            print(line("FLA", ms_fla) + f" | {'1.00':>8} | {errs(res_fla)}   (first call "
                  f"{first:.1f} s)")
        if ms_ours is not None:
            ratio = f"{ms_fla / ms_ours:>8.2f}" if ms_fla else f"{'-':>8}"
            print(line("ours", ms_ours) + f" | {ratio} | {errs(res_ours)}")
        for name, ms_m, same_m in (("ours-k", ms_kept, ms_kept and same_kept),
                                   ("ours-s", ms_saved, ms_saved and same_saved)):
            if ms_m is not None:
                ratio = f"{ms_fla / ms_m:>8.2f}" if ms_fla else f"{'-':>8}"
                print(line(name, ms_m) + f" | {ratio} | "
                      f"{'same bits' if same_m else 'DIFFERENT BITS'}")
        sys.stdout.flush()
        del x, x32
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
