"""The Llama family as a layer list: registration order is the config's, partial builds equal full
builds on any range, buffers are remade by every build, and the layers chain to a sane loss."""

import math

import pytest
import torch

from oobleck_slurm.models import LlamaConfig, llama_config, model_from_dict
from oobleck_slurm.models.llama.hf import LlamaAdapter
from oobleck_slurm.models.llama.model import Attention, build_layers, rope_inv_freq
from oobleck_slurm.models.loss import lm_loss

CFG = llama_config("tiny")
VARIANTS = [
    CFG,
    llama_config("tiny", qkv_bias=True),  # Qwen2
    llama_config("tiny", qkv_bias=True, o_bias=True, mlp_bias=True),
    llama_config("tiny", n_layer=2, head_dim=32, rope_factor=8.0, rope_original_max_len=32),
    llama_config("tiny", n_layer=2, n_kv_heads=4),  # plain multi-head attention
]


@pytest.mark.parametrize("cfg", VARIANTS, ids=["llama", "qwen2", "biases", "head_dim+llama3", "mha"])
def test_registration_order_and_count_match_the_config(cfg: LlamaConfig):
    layers = build_layers(cfg, seed=0)
    assert len(layers) == cfg.num_layers == len(cfg.layer_keys())
    assert [[tuple(p.shape) for p in layer.parameters()] for layer in layers] == cfg.layer_shapes()
    assert sum(p.numel() for layer in layers for p in layer.parameters()) == cfg.num_params
    adapter = LlamaAdapter(cfg)
    for index, layer in enumerate(layers):
        names = list(layer.state_dict())
        assert list(adapter.to_hf(index, layer.state_dict())) == adapter.hf_names(index)
        assert all(hf.endswith(ours) for hf, ours in zip(adapter.hf_names(index), names))
        assert list(adapter.from_hf(index, adapter.to_hf(index, layer.state_dict()))) == names


def test_any_range_builds_the_full_builds_layers_bitwise():
    cfg = VARIANTS[2]
    full = build_layers(cfg, seed=5)
    n = cfg.num_layers
    for start, stop in [(0, 1), (1, 3), (2, n), (n - 1, n), (0, n)]:
        part = build_layers(cfg, seed=5, start=start, stop=stop)
        for a, b in zip(full[start:stop], part):
            sa, sb = a.state_dict(), b.state_dict()
            assert list(sa) == list(sb)
            assert all(torch.equal(sa[k], sb[k]) for k in sa), (start, stop)


def test_seed_and_index_change_weights_and_init_is_as_documented():
    a, b = build_layers(CFG, seed=1), build_layers(CFG, seed=2)
    assert not torch.equal(a[1].self_attn.q_proj.weight, b[1].self_attn.q_proj.weight)
    assert not torch.equal(a[1].self_attn.q_proj.weight, a[2].self_attn.q_proj.weight)
    layers = build_layers(VARIANTS[2], seed=0)
    for layer in layers:
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                assert torch.count_nonzero(p) == 0, name
            elif "norm" in name:
                assert torch.equal(p, torch.ones_like(p)), name
            else:
                assert abs(p.std().item() - 0.02) < 0.004 and abs(p.mean().item()) < 0.004, name


def test_uninitialised_and_meta_builds_have_shapes_and_fresh_buffers():
    cfg = VARIANTS[3]
    layers = build_layers(cfg, seed=0, start=1, stop=3, initialise=False)
    assert [[tuple(p.shape) for p in layer.parameters()] for layer in layers] == cfg.layer_shapes()[1:3]
    attn = layers[0].self_attn
    assert isinstance(attn, Attention)
    assert torch.equal(attn.inv_freq, rope_inv_freq(cfg))
    assert "self_attn.inv_freq" not in layers[0].state_dict()  # not state: never checkpointed
    meta = build_layers(cfg, seed=0, device="meta", initialise=False)
    assert all(p.is_meta for layer in meta for p in layer.parameters())
    assert [[tuple(p.shape) for p in layer.parameters()] for layer in meta] == cfg.layer_shapes()


def test_llama3_scaling_stretches_only_long_wavelengths():
    cfg = llama_config("tiny", head_dim=64, rope_theta=500000.0, rope_factor=8.0, rope_original_max_len=64)
    plain, scaled = rope_inv_freq(llama_config("tiny", head_dim=64, rope_theta=500000.0)), rope_inv_freq(cfg)
    wavelen = 2 * math.pi / plain
    short, long = wavelen < 64 / 4.0, wavelen > 64 / 1.0
    assert short.any() and long.any() and (~short & ~long).any()
    assert torch.equal(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8.0)
    middle = ~short & ~long
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8.0)).all()


def test_layers_chain_to_logits_and_a_near_uniform_loss():
    layers = build_layers(CFG, seed=0)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    h = x
    for index, layer in enumerate(layers):
        h = layer(h)
        if index < CFG.num_layers - 1:
            assert h.shape == (2, *CFG.boundary_shape(index + 1))
    assert h.shape == (2, CFG.seq_len, CFG.vocab_size)
    loss = lm_loss(h[:, :-1], x[:, 1:])
    assert abs(loss.item() - math.log(CFG.vocab_size)) < 0.2
    loss.backward()
    assert all(p.grad is not None for layer in layers for p in layer.parameters())


def test_attention_is_causal():
    layers = build_layers(CFG, seed=0)
    x = torch.randint(0, CFG.vocab_size, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % CFG.vocab_size

    def run(ids):
        h = ids
        for layer in layers:
            h = layer(h)
        return h

    with torch.no_grad():
        assert torch.equal(run(x)[:, :10], run(y)[:, :10])


def test_bf16_autocast_forward_runs():
    layers = build_layers(CFG, seed=0, start=1, stop=2)
    h = torch.randn(2, 8, CFG.d_model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layers[0](h)
    assert out.shape == h.shape and torch.isfinite(out).all()


def test_bad_range_is_a_clear_error():
    with pytest.raises(ValueError, match=r"range \[4, 2\)"):
        build_layers(CFG, seed=0, start=4, stop=2)
    with pytest.raises(ValueError, match=r"range \[0, 7\)"):
        build_layers(CFG, seed=0, start=0, stop=CFG.num_layers + 1)


def test_model_def_builds_through_the_registry():
    cfg = model_from_dict(VARIANTS[3].to_dict())
    assert cfg == VARIANTS[3]
    layers = cfg.build_layers(7, 1, 2)
    assert torch.equal(layers[0].mlp.up_proj.weight, build_layers(cfg, seed=7)[1].mlp.up_proj.weight)
