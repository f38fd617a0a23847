"""Profile sources: the JSON format and its errors, the estimate, a real measurement."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from oobleck_slurm.models import gpt_config
from oobleck_slurm.models.gpt.model import build_layers
from oobleck_slurm.planning import ProfileError, estimate_profile, load_profile, save_profile
from oobleck_slurm.planning.measure import profile_layers


def test_json_round_trip_and_content_key(tmp_path):
    profile = estimate_profile(gpt_config("1.3b"), "A100-40", microbatch_size=4)
    path = tmp_path / "p.json"
    save_profile(profile, path)
    assert load_profile(path) == profile
    data = json.loads(path.read_text())
    data["key"] = ""
    path.write_text(json.dumps(data))
    assert load_profile(path).key == profile.content_hash()  # hand-written files are keyed by content


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("links"), "missing key 'links'"),
    (lambda d: d["layers"][2].update(forward_s="fast"), "key 'layers[2].forward_s' must be a non-negative number"),
    (lambda d: d["links"]["inter_node"].update(bandwidth_Bps=0), "key 'links.inter_node.bandwidth_Bps' must be a positive"),
    (lambda d: d.update(version=7), "key 'version' is 7"),
    (lambda d: d.update(layers=[]), "key 'layers' is empty"),
])
def test_bad_profile_file_names_file_and_key(tmp_path, edit, message):
    data = estimate_profile(gpt_config("tiny"), "H100", microbatch_size=1).to_dict()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=str(path)) as err:
        load_profile(path)
    assert message in str(err.value)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(path)


def test_estimate_shapes_match_the_model_and_optimizers_differ():
    cfg = gpt_config("tiny")
    real = [[tuple(p.shape) for p in layer.parameters()] for layer in build_layers(cfg, seed=0)]
    assert cfg.layer_shapes() == real
    big = gpt_config("175b")
    adamw = estimate_profile(big, "H100", microbatch_size=1, optimizer="adamw")
    came = estimate_profile(big, "H100", microbatch_size=1, optimizer="came", dtype="fp32")
    adamw32 = estimate_profile(big, "H100", microbatch_size=1, optimizer="adamw", dtype="fp32")
    assert sum(x.param_bytes for x in adamw.layers) == 4 * big.num_params  # bf16: fp32 master weights
    assert [x.optimizer_bytes for x in adamw.layers] == [x.optimizer_bytes for x in adamw32.layers]
    assert sum(x.optimizer_bytes for x in came.layers) < 0.6 * sum(x.optimizer_bytes for x in adamw32.layers)
    assert adamw.key != came.key
    blocks = adamw.layers[1:-1]
    assert blocks[0].forward_s > 0 and blocks[0].backward_s == pytest.approx(2 * blocks[0].forward_s)


def test_measured_layers_on_a_real_module_list():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layers = [nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)]
    profiles = profile_layers(layers, torch.randn(4, 32), repeats=3)
    assert [p.param_bytes for p in profiles] == [(32 * 64 + 64) * 4, 0, (64 * 8 + 8) * 4]
    assert [p.output_bytes for p in profiles] == [4 * 64 * 4, 4 * 64 * 4, 4 * 8 * 4]
    assert all(p.forward_s > 0 and p.backward_s > 0 for p in profiles)
    assert profiles[0].activation_bytes == 4 * 32 * 4  # a Linear keeps its input, not its weight
    assert profiles[1].activation_bytes == 4 * 64 * 4  # GELU keeps its input
    assert profiles[0].optimizer_bytes > 2 * profiles[0].param_bytes  # AdamW: two moments + step


def test_recompute_keeps_only_layer_inputs_and_pays_a_forward():
    from oobleck_slurm.models import llama_config
    from oobleck_slurm.planning.profile import with_recompute

    kept = estimate_profile(llama_config("3.1-70b", seq_len=4096), "H100", microbatch_size=1)
    again = with_recompute(kept)
    for i, (a, b) in enumerate(zip(kept.layers, again.layers)):
        assert b.activation_bytes == (kept.layers[i - 1].output_bytes if i else a.activation_bytes)
        assert b.backward_s == a.backward_s + a.forward_s and b.workspace_bytes == a.workspace_bytes + a.activation_bytes
        assert b.state_bytes == a.state_bytes
    block = kept.layers[1]
    assert again.layers[1].activation_bytes < block.activation_bytes / 10  # 70B's block: 1 in 25 bytes kept
    assert again.content_hash() != kept.content_hash()  # templates are cached apart
