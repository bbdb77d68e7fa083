"""Layout parity: HF Llama weights mapped into TE's layout compute HF's logits.

Two independent implementations meet here: transformers' ``LlamaForCausalLM`` (fp32, eager
attention) and ``tests/te_double/reference.py`` (written from TE's documented semantics), fed
through ``te_llama.StateDictAdapter`` and ``te_llama``'s RoPE frequencies. A wrong row order
in the fused QKV or fc1 weight, a wrong GQA grouping or RoPE variant fails these tests.
"""

from __future__ import annotations

import pytest
import torch
from te_double import reference
from transformers import LlamaConfig, LlamaForCausalLM

import te_llama
from model_utils.model import te_support


def llama2_style() -> LlamaConfig:
    """Llama-2 shape family in miniature: default RoPE (theta 1e4), GQA 4:2."""
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )


def llama3_style() -> LlamaConfig:
    """Llama-3 in miniature: theta 5e5, llama3 rope scaling whose bands split this head_dim,
    GQA 8:2 and head_dim 16."""
    return LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=224,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )


CONFIGS = {"llama2": llama2_style, "llama3": llama3_style}


def hf_model(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # non-trivial norm gains so a norm mapped to the wrong slot shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def reference_logits(te_sd: dict, config: LlamaConfig, input_ids: torch.Tensor) -> torch.Tensor:
    """Embed -> reference TE layers (TE-named weights) -> final RMSNorm -> lm_head."""
    hidden = te_sd["model.embed_tokens.weight"][input_ids]
    angles = te_support.rope_angles(
        te_support.llama_rope_inv_freq(config), torch.arange(input_ids.shape[1])
    )
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.{te_llama.TE_LAYER_ATTR}."
        weights = {k[len(prefix) :]: v for k, v in te_sd.items() if k.startswith(prefix)}
        hidden = reference.transformer_layer(
            hidden,
            weights,
            num_heads=config.num_attention_heads,
            num_groups=config.num_key_value_heads,
            head_dim=te_support.head_dim_of(config),
            eps=config.rms_norm_eps,
            rotary_pos_emb=angles,
        )
    hidden = reference.rms_norm(hidden, te_sd["model.norm.weight"], config.rms_norm_eps)
    return hidden @ te_sd["lm_head.weight"].T


@pytest.mark.parametrize("style", CONFIGS)
def test_rope_frequencies_match_hf(style: str) -> None:
    config = CONFIGS[style]()
    ours = te_support.llama_rope_inv_freq(config)
    theirs = LlamaForCausalLM(config).model.rotary_emb.inv_freq
    torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=0)
    if style == "llama3":  # the scaling really changed some frequencies
        plain = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2) / 16))
        assert not torch.allclose(ours, plain)


@pytest.mark.parametrize("style", CONFIGS)
def test_reference_on_te_layout_gives_hf_logits(style: str) -> None:
    config = CONFIGS[style]()
    model = hf_model(config)
    input_ids = torch.randint(
        0, config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = model(input_ids).logits
        te_sd = te_llama.StateDictAdapter(config).from_hf(model.state_dict())
        got = reference_logits(te_sd, config, input_ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)


def test_reference_detects_a_wrong_layout() -> None:
    """The parity check has teeth: swapping gate/up halves of fc1 changes the logits."""
    config = llama2_style()
    model = hf_model(config)
    input_ids = torch.randint(
        0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        expected = model(input_ids).logits
        te_sd = te_llama.StateDictAdapter(config).from_hf(model.state_dict())
        key = f"model.layers.0.{te_llama.TE_LAYER_ATTR}.layernorm_mlp.fc1_weight"
        te_sd[key] = torch.cat(te_sd[key].chunk(2)[::-1])
        got = reference_logits(te_sd, config, input_ids)
    assert (got - expected).abs().max() > 1e-3


@pytest.mark.parametrize("style", CONFIGS)
def test_hf_te_hf_round_trip_is_exact(style: str) -> None:
    config = CONFIGS[style]()
    hf_sd = hf_model(config).state_dict()
    te_sd = te_llama.StateDictAdapter(config).from_hf(hf_sd)
    assert not any(k.startswith("model.layers.0.self_attn") for k in te_sd)
    back = te_llama.StateDictAdapter(config).to_hf(te_sd)
    assert back.keys() == hf_sd.keys()
    for key, tensor in hf_sd.items():
        assert torch.equal(back[key], tensor), key
    again = te_llama.StateDictAdapter(config).from_hf(back)
    assert again.keys() == te_sd.keys()
    assert all(torch.equal(again[k], te_sd[k]) for k in te_sd)


def test_conversion_refuses_incomplete_checkpoints() -> None:
    config = llama2_style()
    hf_sd = dict(hf_model(config).state_dict())
    hf_sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old files: ignored
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in te_llama.StateDictAdapter(
        config
    ).from_hf(hf_sd)
    del hf_sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        te_llama.StateDictAdapter(config).from_hf(hf_sd)
    te_sd = te_llama.StateDictAdapter(config).from_hf(hf_model(config).state_dict())
    te_sd["model.layers.0.transformer_layer.bogus"] = torch.zeros(1)
    with pytest.raises(KeyError, match="bogus"):
        te_llama.StateDictAdapter(config).to_hf(te_sd)


@pytest.mark.parametrize("style", CONFIGS)
def test_te_model_on_double_matches_hf_with_padding(style: str, te_double) -> None:
    """``build_te_llama`` + the double (which computes with the reference) equals HF, also
    for a left-padded batch (HF's 4-D mask becomes TE's ``arbitrary`` mask)."""
    config = CONFIGS[style]()
    model = hf_model(config)
    te_model = te_llama.build_te_llama(config, impl="te").eval()
    missing, unexpected = te_model.load_state_dict(
        te_llama.StateDictAdapter(config).from_hf(model.state_dict()), strict=False
    )
    assert not unexpected and missing and all(map(te_support.is_te_extra_state_key, missing))
    input_ids = torch.randint(
        0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(3)
    )
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :7] = 0
    with torch.no_grad():
        torch.testing.assert_close(
            te_model(input_ids).logits, model(input_ids).logits, rtol=1e-5, atol=2e-5
        )
        model.config._attn_implementation = "sdpa"
        te_out = te_model(input_ids, attention_mask=attention_mask).logits
        hf_out = model(input_ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    torch.testing.assert_close(te_out[keep], hf_out[keep], rtol=1e-5, atol=2e-5)
