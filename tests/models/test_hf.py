"""Hugging Face folders in and out: tiny random models saved by transformers load into our layers with
the same logits and loss; our export loads back into transformers with no missing or unexpected keys
(single file and sharded); malformed folders are HFErrors naming the file and the key."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from oobleck_slurm.models import LlamaConfig, gpt_config, llama_config
from oobleck_slurm.models.hf import (
    HFError,
    has_weights,
    hf_adapter,
    load_layer_weights,
    model_from_hf,
    read_config,
    save_hf,
)
from oobleck_slurm.models.llama.model import rope_inv_freq
from oobleck_slurm.models.loss import lm_loss

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
HF_MODELS = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": ("LlamaConfig", {"rope_parameters": LLAMA3, "num_hidden_layers": 3}),
    "llama-biases-head_dim": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True, "head_dim": 32}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral-long-window": ("MistralConfig", {"sliding_window": 64}),
    "qwen2": ("Qwen2Config", {}),
    "tied": ("LlamaConfig", {"tie_word_embeddings": True}),
}


def transformers_module() -> Any:
    return pytest.importorskip("transformers")


def random_hf_model(kind: str, **overrides: Any) -> Any:
    """A tiny transformers model with every parameter random (biases and norm weights too, so that a
    wrong mapping of any of them shows in the logits)."""
    transformers = transformers_module()
    class_name, extra = HF_MODELS[kind]
    config = getattr(transformers, class_name)(**{**SHAPE, **extra, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return model


def our_layers(folder: Path, **kwargs: Any) -> tuple[Any, list[torch.nn.Module]]:
    cfg = model_from_hf(folder, **kwargs)
    layers = cfg.build_layers(0, 0, cfg.num_layers, initialise=False)
    for index, layer in enumerate(layers):
        load_layer_weights(folder, cfg, index, layer)
    return cfg, layers


def forward(layers: list[torch.nn.Module], ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        h = ids
        for layer in layers:
            h = layer(h)
    return h


def batch(seq: int = 33) -> torch.Tensor:
    return torch.randint(0, 256, (3, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(HF_MODELS))
def test_transformers_checkpoint_gives_its_logits_and_loss(kind: str, tmp_path: Path):
    model = random_hf_model(kind)
    model.save_pretrained(tmp_path)
    cfg, layers = our_layers(tmp_path)
    assert isinstance(cfg, LlamaConfig) and cfg.seq_len == SHAPE["max_position_embeddings"]
    x = batch()
    with torch.no_grad():
        reference = model(x, labels=x)
    logits = forward(layers, x)
    torch.testing.assert_close(logits, reference.logits, atol=1e-5, rtol=0)
    # transformers shifts labels inside; ours takes inputs x[:, :-1] and targets x[:, 1:]
    loss = lm_loss(logits[:, :-1], x[:, 1:])
    torch.testing.assert_close(loss, reference.loss, atol=1e-5, rtol=0)


def test_config_fields_are_read(tmp_path: Path):
    random_hf_model("llama3-rope").save_pretrained(tmp_path / "a")
    cfg = model_from_hf(tmp_path / "a", seq_len=48)
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_kv_heads, cfg.ffn_dim, cfg.seq_len) == (3, 64, 4, 2, 96, 48)
    assert (cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_len) == (500000.0, 8.0, 32)
    random_hf_model("qwen2").save_pretrained(tmp_path / "b")
    qwen = model_from_hf(tmp_path / "b")
    assert (qwen.qkv_bias, qwen.o_bias, qwen.mlp_bias) == (True, False, False)


def test_llama3_frequencies_equal_transformers():
    transformers = transformers_module()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(**SHAPE, rope_parameters=dict(LLAMA3))
    reference, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    cfg = llama_config("tiny", rope_theta=500000.0, rope_factor=8.0, rope_original_max_len=32)
    torch.testing.assert_close(rope_inv_freq(cfg), reference, atol=0, rtol=1e-6)


def test_transformers_4_rope_keys_are_read(tmp_path: Path):
    config = {"architectures": ["LlamaForCausalLM"], **SHAPE, "rope_theta": 500000.0,
              "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 32}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = model_from_hf(tmp_path)
    assert (cfg.rope_theta, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
            cfg.rope_original_max_len) == (500000.0, 8.0, 1.0, 4.0, 32)
    config["rope_scaling"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_from_hf(tmp_path).rope_factor is None


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "qwen2", "llama-biases-head_dim"])
def test_export_loads_into_transformers_with_the_same_logits(kind: str, tmp_path: Path):
    transformers = transformers_module()
    random_hf_model(kind).save_pretrained(tmp_path / "in")
    cfg, layers = our_layers(tmp_path / "in")
    files = save_hf(tmp_path / "out", cfg, ((i, layer.state_dict()) for i, layer in enumerate(layers)))
    assert [f.name for f in files] == ["config.json", "model.safetensors"]
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".tmp")]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.architectures == read_config(tmp_path / "in")["architectures"]
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x).logits, forward(layers, x), atol=1e-5, rtol=0)


def test_export_of_fresh_layers_then_sharded_reload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    transformers = transformers_module()
    cfg = llama_config("tiny", n_layer=3, qkv_bias=True)
    layers = cfg.build_layers(4, 0, cfg.num_layers)
    states = [(i, layer.state_dict()) for i, layer in enumerate(layers)]
    files = save_hf(tmp_path, cfg, reversed(states), max_shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert {f.name for f in files} == {"config.json", "model.safetensors.index.json", *shards}
    total = sum(t.numel() * 4 for s in shards for t in load_file(tmp_path / s).values())
    assert index["metadata"]["total_size"] == total == cfg.num_params * 4
    assert not (tmp_path / "model.safetensors").exists()

    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(model).__name__ == "Qwen2ForCausalLM"
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x).logits, forward(layers, x), atol=1e-5, rtol=0)

    # a layer reads only the shards that hold its tensors
    import safetensors

    opened: list[str] = []
    real_open = safetensors.safe_open

    def recording_open(path: str, *args: Any, **kwargs: Any) -> Any:
        opened.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", recording_open)
    again = model_from_hf(tmp_path)
    assert again == cfg
    block = again.build_layers(0, 2, 3, initialise=False)[0]
    load_layer_weights(tmp_path, again, 2, block)
    needed = {index["weight_map"][n] for n in hf_adapter(again).hf_names(2)}
    assert set(opened) == needed and len(opened) == len(needed) < len(shards)
    assert all(torch.equal(a, b) for a, b in zip(block.state_dict().values(), layers[2].state_dict().values()))

    # a smaller save to the same folder replaces the shards with one file
    save_hf(tmp_path, cfg, states)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_gpt2_export_matches_transformers_and_reads_back(tmp_path: Path):
    transformers = transformers_module()
    cfg = gpt_config("tiny", n_layer=2, seq_len=32)
    layers = cfg.build_layers(3, 0, cfg.num_layers)
    with torch.no_grad():  # biases and LayerNorms away from their init, the key bias included
        for layer in layers:
            for name, p in layer.named_parameters():
                if name.endswith("bias") or ".ln" in f".{name}":
                    p.add_(0.1 * torch.randn_like(p))
    save_hf(tmp_path, cfg, enumerate(layer.state_dict() for layer in layers))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight is not model.transformer.wte.weight
    x = batch(32)
    ours = forward(layers, x)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x).logits, ours, atol=1e-5, rtol=0)
    again, back = our_layers(tmp_path, seq_len=16)
    assert again == gpt_config("tiny", n_layer=2, seq_len=16)
    torch.testing.assert_close(forward(back, x[:, :16]), ours[:, :16], atol=1e-5, rtol=0)


def test_gpt2_with_approximate_gelu_is_refused(tmp_path: Path):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
              "n_positions": 32, "vocab_size": 256, "activation_function": "gelu_new"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFError, match=r"config\.json: key 'activation_function' = 'gelu_new'"):
        model_from_hf(tmp_path)


# ---- errors -------------------------------------------------------------------------------------


def write_config(folder: Path, **changes: Any) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE, **changes}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))
    return folder


def test_missing_folder_and_config_and_bad_json(tmp_path: Path):
    with pytest.raises(HFError, match="nope: not a directory"):
        model_from_hf(tmp_path / "nope")
    with pytest.raises(HFError, match=r"config\.json: missing"):
        model_from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{\"hidden_size\": 64,")
    with pytest.raises(HFError, match=r"config\.json: cannot be read as JSON"):
        model_from_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(HFError, match=r"config\.json: expected a JSON object"):
        model_from_hf(tmp_path)


@pytest.mark.parametrize(("changes", "message"), [
    ({"architectures": ["BertForMaskedLM"]},
     r"key 'architectures' = \['BertForMaskedLM'\]: not supported; supported: LlamaForCausalLM, Mistral"),
    ({"architectures": ..., "model_type": "phi"},
     r"neither key 'architectures' nor key 'model_type' \(= 'phi'\).*supported: LlamaForCausalLM"),
    ({"hidden_act": "gelu"}, r"key 'hidden_act' = 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"key 'rope_parameters': rope type 'yarn'"),
    ({"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}, r"key 'rope_scaling': rope type"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
     r"key 'rope_parameters': missing key 'low_freq_factor'"),
    ({"hidden_size": ...}, r"missing key 'hidden_size'"),
    ({"num_hidden_layers": "2"}, r"key 'num_hidden_layers' = '2': expected a positive int"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 16}, r"key 'sliding_window' = 16 is shorter than "
     r"the sequence length 64"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
     r"key 'sliding_window' = 16"),
])
def test_unsupported_configs_name_the_file_and_key(tmp_path: Path, changes: dict, message: str):
    write_config(tmp_path, **changes)
    with pytest.raises(HFError, match=r"config\.json: " + message):
        model_from_hf(tmp_path)


def test_sliding_window_is_fine_when_it_covers_the_sequence(tmp_path: Path):
    write_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=16)
    assert model_from_hf(tmp_path, seq_len=16).seq_len == 16
    write_config(tmp_path, architectures=["Qwen2ForCausalLM"], use_sliding_window=False, sliding_window=16)
    assert model_from_hf(tmp_path).seq_len == 64


def test_missing_weights_tensor_and_shape_mismatch(tmp_path: Path):
    cfg = llama_config("tiny", n_layer=2)
    layers = cfg.build_layers(0, 0, cfg.num_layers)
    write_config(tmp_path)
    assert not has_weights(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(HFError, match=r"no model\.safetensors or model\.safetensors\.index\.json \(found "
                                      r"pytorch_model\.bin: convert"):
        load_layer_weights(tmp_path, cfg, 1, layers[1])

    save_hf(tmp_path, cfg, enumerate(layer.state_dict() for layer in layers))
    assert has_weights(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    load_layer_weights(tmp_path, cfg, 0, layers[0])
    with pytest.raises(HFError, match=r"model\.safetensors: no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_layer_weights(tmp_path, cfg, 2, layers[2])
    with pytest.raises(HFError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' "
                                      r"has shape \[8, 64\], but layer 1 \(block\.00\)"):
        load_layer_weights(tmp_path, cfg, 1, layers[1])


def test_sharded_index_naming_a_missing_shard(tmp_path: Path):
    cfg = llama_config("tiny", n_layer=2)
    layers = cfg.build_layers(0, 0, cfg.num_layers)
    save_hf(tmp_path, cfg, enumerate(layer.state_dict() for layer in layers), max_shard_bytes=50_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = index["weight_map"]["lm_head.weight"]
    (tmp_path / victim).unlink()
    with pytest.raises(HFError, match=rf"index\.json: names the file {victim}, which is missing"):
        load_layer_weights(tmp_path, cfg, cfg.num_layers - 1, layers[-1])


def test_save_needs_every_layer_once(tmp_path: Path):
    cfg = llama_config("tiny", n_layer=2)
    layers = cfg.build_layers(0, 0, cfg.num_layers)
    with pytest.raises(ValueError, match=r"layers \[3\] were not given"):
        save_hf(tmp_path, cfg, [(i, layers[i].state_dict()) for i in range(3)])
    with pytest.raises(ValueError, match="layer 1 is given twice"):
        save_hf(tmp_path, cfg, [(1, layers[1].state_dict())] * 2)
    assert list(tmp_path.iterdir()) == []
