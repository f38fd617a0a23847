"""A Hugging Face model through the whole tool, as a user brings one: a tiny random Llama (with its own
tokenizer.json) and a Qwen2 saved by transformers; `submit` with `model: {hf: DIR}` trains from their
weights through a kill -9 drill (every step's loss and the final parameters equal the single-process
reference, fp64); the step-0 loss equals transformers' loss on the same batch; `export --format hf`
writes a folder that transformers loads with no missing or unexpected keys and the job's logits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from oobleck_slurm.data import DEFAULT_TEXT
from oobleck_slurm.engine.checkpoint import layer_file, read_layer_file

from .test_hf import random_hf_model

pytestmark = pytest.mark.slow


def byte_level_tokenizer(folder: Path) -> int:
    """A BPE tokenizer.json trained on the shipped text (its vocabulary is the model's), in `folder`."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=320, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(DEFAULT_TEXT)], trainer)
    tok.save(str(folder / "tokenizer.json"))
    return int(tok.get_vocab_size(with_added_tokens=True))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_hf_model_trains_through_a_kill_and_exports_back(kind: str, tmp_path: Path, templates_cache: Path) -> None:
    from jobrun import assert_matches_reference, run_job, tiny_recipe

    transformers = pytest.importorskip("transformers")
    src = tmp_path / "hf-in"
    src.mkdir()
    vocab = byte_level_tokenizer(src) if kind == "llama" else 256  # qwen2: the byte tokenizer
    random_hf_model(kind, vocab_size=vocab).save_pretrained(src)
    # a memory budget that makes pipelines of 2 and 3 nodes (qwen2's byte vocabulary makes it smaller)
    recipe: dict[str, Any] = tiny_recipe(nodes=5, steps=4, memory="5MB" if kind == "llama" else "4MB")
    recipe["model"] = {"hf": str(src), "seq_len": 32}
    run = run_job(tmp_path, recipe, templates_cache, faults=[{"node": "node2", "step": 2, "at": "wait:last"}])
    spec = run.spec()
    assert spec.model.weights == str(src) and spec.model.vocab_size == vocab
    assert run.kind("failure")[0]["nodes"] == ["node2"]
    assert any(len(p["stages"]) > 1 for p in run.first("plan")["pipelines"])  # hidden states crossed stages
    assert_matches_reference(run)

    # step 0 trained on the weights transformers saved: its loss is transformers' loss on that batch
    from oobleck_slurm.engine.worker import Worker

    batches = Worker(spec, 0).batches
    windows = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in
                         (batches.microbatch(0, m) for m in range(spec.train.num_microbatches))])
    hf_in = transformers.AutoModelForCausalLM.from_pretrained(src).double().eval()
    with torch.no_grad():
        hf_loss = float(hf_in(windows, labels=windows).loss)
    # 1e-6: both compute RMSNorm and the rotary angles in float32 even in a float64 model
    assert abs(run.losses()[0] - hf_loss) <= 1e-6 * hf_loss, (run.losses()[0], hf_loss)

    out = tmp_path / "hf-out"
    done = subprocess.run([sys.executable, "-m", "oobleck_slurm", "export", str(run.job.path), "--format", "hf",
                           "--out", str(out), "--max-shard-size", "100KB"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (out / "model.safetensors.index.json").is_file()  # above 100 KB: sharded
    assert (out / "tokenizer.json").is_file() == (kind == "llama")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # the job's final model (its checkpoint, in fp32) gives transformers' logits
    layers = spec.model.config.build_layers(0, 0, spec.model.num_layers, initialise=False)
    for key, layer in zip(spec.model.keys(), layers):
        tensors = read_layer_file(layer_file(run.job.checkpoints, spec.train.steps, key))
        layer.load_state_dict({n.split(".", 1)[1]: t.float() for n, t in tensors.items()
                               if n.startswith(("param.", "buffer."))}, strict=False)
    h = windows[:4, :-1]
    with torch.no_grad():
        for layer in layers:
            h = layer(h)
        torch.testing.assert_close(model.eval()(windows[:4, :-1]).logits, h, atol=1e-5, rtol=0)
