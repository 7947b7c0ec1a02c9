"""A hybridlm config.json (the compact glm5_next_text form `hybridlm` writes, or a glm5_next one)
as the keyword arguments of transformers' Glm5NextTextConfig: layer_pattern becomes layer_types,
first_k_dense_replace becomes mlp_layer_types, indexer_types defaults to all "full", and
pad_token_id to None (transformers' default, 154820, is outside a small vocabulary)."""


def transformers_kwargs(cfg):
    if cfg.get("model_type") == "glm5_next" and "text_config" in cfg:
        cfg = cfg["text_config"]
    cfg = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "transformers_version")}
    L = cfg["num_hidden_layers"]
    if "layer_pattern" in cfg:
        cfg["layer_types"] = ["linear_attention" if c == "K" else "deepseek_sparse_attention"
                              for c in cfg.pop("layer_pattern")]
    if "mlp_layer_types" not in cfg and "first_k_dense_replace" in cfg:
        k = cfg.pop("first_k_dense_replace")
        cfg["mlp_layer_types"] = ["dense"] * k + ["sparse"] * (L - k)
    cfg.setdefault("indexer_types", ["full"] * L)
    cfg.setdefault("pad_token_id", None)
    return cfg
