"""Tiny random transformers Qwen3 / Qwen3-MoE models for parity tests."""

# Tiny configs covering what the parity tests must: tied and untied embeddings, GQA ratios > 1,
# norm_topk_prob both ways, decoder_sparse_step > 1, an mlp_only_layers list.
DENSE_CONFIGS = {
    "dense_tied_gqa2": dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            tie_word_embeddings=True, rope_theta=10000.0),
    "dense_untied_gqa4": dict(vocab_size=131, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                              tie_word_embeddings=False, rope_theta=1_000_000.0),
}
MOE_CONFIGS = {
    "moe_norm_topk": dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                          tie_word_embeddings=False),
    "moe_sparse_step2_unnormed": dict(vocab_size=89, hidden_size=32, intermediate_size=40,
                                      moe_intermediate_size=24, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                                      decoder_sparse_step=2, tie_word_embeddings=True),
    "moe_mlp_only_layers": dict(vocab_size=97, hidden_size=32, intermediate_size=48,
                                moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=6,
                                num_key_value_heads=3, head_dim=8, num_experts=5, num_experts_per_tok=2,
                                norm_topk_prob=True, mlp_only_layers=[0, 2], tie_word_embeddings=False),
}
ALL_CONFIGS = {**DENSE_CONFIGS, **MOE_CONFIGS}


def build_hf_model(name: str, seed: int = 0):
    """A random transformers Qwen3 / Qwen3-MoE model of the named tiny config, in eval mode."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if name in DENSE_CONFIGS:
        model = Qwen3ForCausalLM(Qwen3Config(**DENSE_CONFIGS[name]))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE_CONFIGS[name]))
    # transformers initialises norms to 1; randomise them so a swapped norm cannot hide.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def char_engine(tmp_path_factory, seed: int = 3):
    """A bf16 sampler ``Engine`` over a one-layer random Qwen3 with the character tokenizer's
    vocabulary: what episode and sampler-loop tests drive environments through."""
    from convert.qwen3_config import Qwen3Config
    from convert.tokenizer import char_tokenizer
    from sampler_torch.engine import Engine
    from trainer_jax.models import init_model, save_hf

    tok = char_tokenizer()
    cfg = Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      tie_word_embeddings=True)
    tok_dir = tmp_path_factory.mktemp("tok")
    tok.save(str(tok_dir / "tokenizer.json"))
    path = save_hf(init_model(cfg, seed=seed), cfg, tmp_path_factory.mktemp("w") / "bf16",
                   dtype="bfloat16", tokenizer_dir=tok_dir)
    return Engine(path, "bf16")
