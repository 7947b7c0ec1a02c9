"""Compare two safetensors files tensor by tensor: compare.py REF OURS [--tol 1e-4].
Names match after removing a leading "model." or "model.language_model." (and the same after a
"grad." prefix). Prints the relative L2 error ||ours - ref|| / ||ref|| and the max abs error of
every tensor of REF, and exits with status 1 when any is missing or above the tolerance."""
import argparse, re, sys

from safetensors.torch import load_file

ap = argparse.ArgumentParser()
ap.add_argument("ref")
ap.add_argument("ours")
ap.add_argument("--tol", type=float, default=1e-4)
args = ap.parse_args()


def norm(name):
    pre = ""
    if name.startswith("grad."):
        pre, name = "grad.", name[5:]
    name = re.sub(r"^(model\.language_model\.|model\.)", "", name)
    return pre + name


ref = {norm(k): v.double() for k, v in load_file(args.ref).items()}
ours = {norm(k): v.double() for k, v in load_file(args.ours).items()}
bad = 0
worst = 0.0
for name in sorted(ref):
    r = ref[name]
    if name not in ours:
        print(f"MISSING  {name}")
        bad += 1
        continue
    o = ours[name]
    if o.shape != r.shape:
        print(f"SHAPE    {name}: ours {tuple(o.shape)} ref {tuple(r.shape)}")
        bad += 1
        continue
    den = r.norm().item()
    rel = (o - r).norm().item() / den if den > 0 else (o - r).norm().item()
    worst = max(worst, rel)
    flag = "FAIL" if rel > args.tol else "ok"
    if rel > args.tol:
        bad += 1
    print(f"{flag:8s} {name:70s} rel {rel:.3e}  max_abs {(o - r).abs().max().item():.3e}")
print(f"{len(ref)} tensors, worst relative error {worst:.3e}, {bad} failing (tol {args.tol:g})")
sys.exit(1 if bad else 0)
