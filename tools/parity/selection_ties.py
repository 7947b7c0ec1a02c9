"""Compare the DSA selections of hybridlm (ours.safetensors: dsa_indices.layers.<i>) with the
reference's (indices.safetensors: layers.<i>) row by row, and check each differing row against the
reference's pool scores (pool_scores.safetensors: the values its topk ranked): a row whose k-th and
(k+1)-th best scores are equal has a tie at the cut, where the order is implementation-defined.
  selection_ties.py DIR OURS.safetensors K_POOLS"""
import sys

import torch
from safetensors.torch import load_file

d, ours_path, kp = sys.argv[1], sys.argv[2], int(sys.argv[3])
ref = load_file(f"{d}/indices.safetensors")
sc = load_file(f"{d}/pool_scores.safetensors")
ours = load_file(ours_path)
for name, r in ref.items():
    o = ours["dsa_indices." + name]
    s = sc[name]  # [B, S, pools]
    B, S = r.shape[:2]
    differ = tied = differ_tied = 0
    for b in range(B):
        for t in range(S):
            rs = set(x for x in r[b, t].tolist() if x >= 0)
            os_ = set(x for x in o[b, t].tolist() if x >= 0)
            row = s[b, t]
            k = min(kp, row.numel())
            tie = False
            if row.numel() > k:
                v = torch.sort(row, descending=True).values
                tie = bool(v[k - 1] == v[k]) and v[k] > torch.finfo(torch.float32).min
            tied += tie
            if rs != os_:
                differ += 1
                differ_tied += tie
    print(f"{name}: {B * S} rows, {differ} with a different set, {tied} with a tie at the cut, "
          f"{differ_tied} of the differing rows have a tie at the cut")
