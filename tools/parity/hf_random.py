"""Random parameters for a transformers Glm5NextTextModel (the parity scripts' models): every
parameter drawn, so that no zero or one initialisation can hide a mismatch. A_log ~ U(-0.5, 0.5),
dt_bias ~ U(-1, 1), norm weights and mHC scales 1 + 0.1 N(0, 1), the router's correction bias
0.05 N(0, 1), every other matrix scale * N(0, 1) and every other vector 5 * scale * N(0, 1)."""
import torch


def randomize(model, scale):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-0.5, 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.0))
            elif p.dim() == 1 and ("norm" in name or name.endswith("scale")):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p) * (1.0 if p.dim() > 1 else 5.0))
