"""GPT as a layer list: partial builds equal full builds, shapes chain, tying is explicit."""

import pytest
import torch

from oobleck_slurm.models import GPTConfig, gpt_config
from oobleck_slurm.models.gpt.model import build_layers
from oobleck_slurm.models.loss import lm_loss

CFG = gpt_config("tiny")


def test_keys_are_stable_and_unique():
    keys = CFG.layer_keys()
    assert keys == ["embed", "block.00", "block.01", "block.02", "block.03", "head"]
    assert len(keys) == CFG.num_layers
    assert len(gpt_config("tiny", n_layer=120).layer_keys()) == 122


def test_partial_build_is_bit_identical_to_full_build():
    full = build_layers(CFG, seed=3)
    for start, stop in [(0, 1), (1, 4), (2, 6), (5, 6)]:
        part = build_layers(CFG, seed=3, start=start, stop=stop)
        for a, b in zip(full[start:stop], part):
            for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
                assert na == nb and torch.equal(pa, pb), (start, stop, na)


def test_seed_and_layer_index_change_weights():
    a = build_layers(CFG, seed=1)
    b = build_layers(CFG, seed=2)
    assert not torch.equal(a[1].fc.weight, b[1].fc.weight)
    assert not torch.equal(a[1].fc.weight, a[2].fc.weight)


def test_layers_chain_to_logits_and_loss():
    layers = build_layers(CFG, seed=0)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    h = x
    for layer in layers:
        h = layer(h)
    assert h.shape == (2, CFG.seq_len, CFG.vocab_size)
    loss = lm_loss(h, x)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # near-uniform at init


def test_bad_range_is_a_clear_error():
    with pytest.raises(ValueError, match=r"range \[4, 2\)"):
        build_layers(CFG, seed=0, start=4, stop=2)


def test_tied_embeddings_single_stage_shares_weight_and_partial_build_refuses():
    cfg = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, tie_embeddings=True)
    layers = build_layers(cfg, seed=0)
    assert layers[-1].lm_head.weight is layers[0].tok.weight
    with pytest.raises(NotImplementedError, match="tie_embeddings=True"):
        build_layers(cfg, seed=0, start=0, stop=2)


def test_parameter_count_matches_config():
    assert sum(p.numel() for layer in build_layers(CFG, 0) for p in layer.parameters()) == CFG.num_params
