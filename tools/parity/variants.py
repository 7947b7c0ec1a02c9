"""Write parity configs that isolate one part of the model each, from a base config:
variants.py BASE.json OUTDIR -> OUTDIR/<name>.json for name in the list below."""
import json, os, sys

base = json.load(open(sys.argv[1]))
out = sys.argv[2]
os.makedirs(out, exist_ok=True)
variants = {
    "kda_dense": {"num_hidden_layers": 1, "layer_pattern": "K", "first_k_dense_replace": 1},
    "dsa_dense": {"num_hidden_layers": 1, "layer_pattern": "D", "first_k_dense_replace": 1},
    "kda_moe": {"num_hidden_layers": 1, "layer_pattern": "K", "first_k_dense_replace": 0},
    "full": {},
}
for name, over in variants.items():
    c = dict(base) | over
    json.dump(c, open(os.path.join(out, name + ".json"), "w"), indent=1)
    print(name)
