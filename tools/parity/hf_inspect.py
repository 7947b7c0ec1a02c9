"""Print what the installed transformers defines for glm5_next: its version, the default
Glm5NextTextConfig, and the parameter names and shapes of a tiny random model. With an output
directory, also copy the modeling/configuration sources there for reading."""
import json, os, shutil, sys

import torch
import transformers

out = sys.argv[1] if len(sys.argv) > 1 else None
print("transformers", transformers.__version__, "torch", torch.__version__)
from transformers import models

mod_dir = os.path.join(os.path.dirname(models.__file__), "glm5_next")
print("module dir", mod_dir, os.listdir(mod_dir) if os.path.isdir(mod_dir) else "MISSING")
if out and os.path.isdir(mod_dir):
    for f in os.listdir(mod_dir):
        if f.endswith(".py"):
            shutil.copy(os.path.join(mod_dir, f), os.path.join(out, f))
from transformers.models.glm5_next import configuration_glm5_next as cfgmod

names = [n for n in dir(cfgmod) if n.endswith("Config")]
print("configs", names)
for n in names:
    c = getattr(cfgmod, n)()
    d = c.to_dict()
    print(n, json.dumps(d, indent=1, default=str)[:20000])
