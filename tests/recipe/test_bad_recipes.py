"""Every bad recipe gets a message naming the file, the line, the key path and what is wrong."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from oobleck_slurm.recipe import RecipeError, load_recipe

# (case id, recipe text, key path, line or None, words the message must contain)
BAD_RECIPES = [
    ("unknown-section", "traning:\n  steps: 3\n", "traning", 1, "did you mean 'training'"),
    ("unknown-key-typo", "cluster:\n  partiton: gpu\n", "cluster.partiton", 2, "did you mean 'cluster.partition'"),
    ("key-in-wrong-section", "training:\n  nodes: 4\n", "training.nodes", 2, "did you mean 'cluster.nodes'"),
    ("unknown-key-no-match", "model:\n  zzz: 1\n", "model.zzz", 2, "model accepts: family, size"),
    ("microbatch-not-int", "training:\n  microbatch_size: four\n", "training.microbatch_size", 2, "expected an integer, got str 'four'"),
    ("microbatch-float", "training:\n  microbatch_size: 2.5\n", "training.microbatch_size", 2, "expected an integer"),
    ("microbatch-zero", "training:\n  microbatch_size: 0\n", "training.microbatch_size", 2, "must be > 0"),
    ("batch-not-divisible", "training:\n  global_batch_size: 30\n  microbatch_size: 4\n", "training.microbatch_size", 3, "30 is not divisible by microbatch_size 4"),
    ("too-few-microbatches", "training:\n  global_batch_size: 4\n  microbatch_size: 4\nfault_tolerance:\n  f: 1\n", "training.global_batch_size", 2, "cannot feed f+1=2 pipelines"),
    ("f-ge-nodes", "cluster:\n  nodes: 2\nfault_tolerance:\n  f: 2\n", "fault_tolerance.f", 4, "needs at least f+1=3 nodes"),
    ("f-negative", "fault_tolerance:\n  f: -1\n", "fault_tolerance.f", 2, "must be >= 0"),
    ("nodes-bool", "cluster:\n  nodes: yes\n", "cluster.nodes", 2, "expected an integer, got bool True"),
    ("backend-unknown", "cluster:\n  backend: slrum\n", "cluster.backend", 2, "did you mean 'slurm'"),
    ("optimizer-unknown", "training:\n  optimizer:\n    name: adam\n", "training.optimizer.name", 3, "did you mean 'adamw'"),
    ("optimizer-sgd", "training:\n  optimizer:\n    name: sgd\n", "training.optimizer.name", 3, "expected one of 'adamw', 'came'"),
    ("lr-negative", "training:\n  optimizer:\n    lr: -0.1\n", "training.optimizer.lr", 3, "must be > 0"),
    ("lr-text", "training:\n  optimizer:\n    lr: fast\n", "training.optimizer.lr", 3, "expected a number, got str 'fast'"),
    ("betas-wrong-count-came", "training:\n  optimizer:\n    name: came\n    betas: [0.9, 0.99]\n", "training.optimizer.betas", 4, "came takes 3 betas, got 2"),
    ("betas-out-of-range", "training:\n  optimizer:\n    betas: [0.9, 1.5]\n", "training.optimizer.betas", 3, "each beta must be in [0, 1)"),
    ("eps-wrong-count", "training:\n  optimizer:\n    eps: [1.0e-8, 1.0e-9]\n", "training.optimizer.eps", 3, "adamw takes 1 eps value(s), got 2"),
    ("model-unknown-family", "model:\n  family: mamba\n", "model.family", 2, "expected one of 'gpt', 'llama'"),
    ("model-unknown-size", "model:\n  size: 7b\n", "model.size", 2, "unknown gpt size '7b'; known: tiny, mini"),
    ("model-llama-unknown-size", "model:\n  family: llama\n  size: 1.3b\n", "model.size", 3, "known: tiny, mini, 3.2-1b"),
    ("model-key-of-another-family", "model:\n  size: tiny\n  n_kv_heads: 2\n", "model.n_kv_heads", 3,
     "the gpt family has no 'n_kv_heads'"),
    ("model-kv-heads-not-divisor", "model:\n  family: llama\n  n_kv_heads: 3\n", "model.n_kv_heads", 3,
     "n_head=4 is not a multiple of n_kv_heads=3"),
    ("model-hf-and-factory", "model:\n  hf: somewhere\n  factory: a.b:c\n", "model.factory", 3, "not both"),
    ("model-hf-missing", "model:\n  hf: no-such-folder\n", "model.hf", 2, "no-such-folder"),
    ("model-hf-with-shape", "model:\n  hf: somewhere\n  n_layer: 3\n", "model.n_layer", 3,
     "model.hf takes the model's shape from its config.json: remove model.n_layer"),
    ("model-heads-not-divisor", "model:\n  size: tiny\n  n_head: 5\n", "model.n_head", 3, "d_model 64 is not divisible by n_head 5"),
    ("model-factory-bad-format", "model:\n  factory: mypkg.models.build\n", "model.factory", 2, "expected 'package.module:function'"),
    ("model-kwargs-without-factory", "model:\n  kwargs: {depth: 3}\n", "model.kwargs", 2, "model.factory, which is not set"),
    ("precision-unknown", "training:\n  precision: fp16\n", "training.precision", 2, "expected one of 'fp32', 'bf16'"),
    ("timeouts-out-of-order", "fault_tolerance:\n  collective_timeout: 5\n  heartbeat_lease: 3\n", "fault_tolerance.heartbeat_lease", 3, "collective_timeout (5 s) < heartbeat_lease (3 s) is required"),
    ("step-below-lease", "fault_tolerance:\n  step_timeout: 1\n", "fault_tolerance.step_timeout", 2, "heartbeat_lease (3 s) < step_timeout (1 s)"),
    ("reconf-below-step", "fault_tolerance:\n  reconfiguration_timeout: 30\n", "fault_tolerance.reconfiguration_timeout", 2, "step_timeout (60 s) < reconfiguration_timeout (30 s)"),
    ("heartbeat-interval-above-lease", "fault_tolerance:\n  heartbeat_interval: 5\n", "fault_tolerance.heartbeat_lease", None, "must exceed heartbeat_interval (5 s)"),
    ("replacement-unknown", "fault_tolerance:\n  replacement: maybe\n", "fault_tolerance.replacement", 2, "expected one of 'spare', 'request', 'none'"),
    ("spare-without-spares", "fault_tolerance:\n  replacement: spare\n", "fault_tolerance.replacement", 2, "needs cluster.spare_nodes >= 1"),
    ("slurm-time-bad", "cluster:\n  time: 2 hours\n", "cluster.time", 2, "expected a Slurm time limit"),
    ("sbatch-reserved", "cluster:\n  sbatch:\n    nodes: 3\n", "cluster.sbatch", 2, "use cluster.nodes instead"),
    ("sbatch-dashes", "cluster:\n  sbatch:\n    --mail-type: END\n", "cluster.sbatch", 2, "not an sbatch long option name"),
    ("sbatch-network", "cluster:\n  sbatch:\n    network: job_vni\n", "cluster.sbatch", 2, "use cluster.network instead"),
    ("sbatch-underscored-reserved", "cluster:\n  sbatch:\n    no_kill: true\n", "cluster.sbatch", 2, "set by oobleck-slurm"),
    ("network-bad", "cluster:\n  network: job vni\n", "cluster.network", 2, "expected Slurm's --network value"),
    ("requeues-negative", "cluster:\n  requeues: -1\n", "cluster.requeues", 2, "must be >= 0"),
    ("signal-delay-zero", "cluster:\n  signal_delay_s: 0\n", "cluster.signal_delay_s", 2, "between 1 and 65535"),
    ("signal-delay-after-limit", "cluster:\n  time: '2'\n  signal_delay_s: 120\n", "cluster.signal_delay_s", 3,
     "is not less than cluster.time '2' (120 s)"),
    ("time-above-centre-limit", "cluster:\n  time: '03:00:00'\n  max_time: '02:00:00'\n", "cluster.time", 2,
     "exceeds cluster.max_time '02:00:00'"),
    ("slingshot-replacement-job", "cluster:\n  backend: slurm\n  network: single_node_vni,job_vni\n"
     "fault_tolerance:\n  replacement: request\n", "fault_tolerance.replacement", 5, "cannot reach this job's"),
    ("slingshot-failover", "cluster:\n  backend: slurm\n  network: job_vni\n  supervisor:\n    failover: true\n"
     "fault_tolerance:\n  replacement: none\n", "cluster.supervisor.failover", 5, "workers of different jobs"),
    ("section-not-mapping", "training: 5\n", "training", 1, "expected a mapping of TrainingConfig keys, got int 5"),
    ("top-level-list", "- a\n- b\n", "", 1, "a recipe must be a mapping"),
    ("yaml-syntax", "cluster:\n  nodes: [1, 2\n", "", 3, "YAML syntax error"),
    ("duplicate-key", "cluster:\n  nodes: 2\n  nodes: 3\n", "cluster.nodes", 3, "key given twice"),
    ("warmup-over-steps", "training:\n  steps: 10\n  lr_schedule:\n    warmup_steps: 20\n", "training.lr_schedule.warmup_steps", 4, "exceed training.steps (10)"),
    ("min-lr-over-lr", "training:\n  optimizer:\n    lr: 1.0e-4\n  lr_schedule:\n    min_lr: 1.0e-3\n", "training.lr_schedule.min_lr", 5, "exceeds optimizer.lr"),
    ("data-missing-file", "data:\n  path: no/such/tokens.bin\n", "data.path", 2, "file not found"),
    ("data-path-and-text", "data:\n  path: r.yaml\n  text: r.yaml\n", "data.text", 3, "not both"),
    ("data-tokenizer-bad", "data:\n  tokenizer: gpt2\n", "data.tokenizer", 2, "expected 'byte', a tokenizer.json path or 'package.module:function'"),
    ("data-tokenizer-missing", "data:\n  tokenizer: tok/tokenizer.json\n", "data.tokenizer", 2, "no Hugging Face tokenizer at"),
    ("grad-clip-negative", "training:\n  grad_clip: -1\n", "training.grad_clip", 2, "must be >= 0"),
    ("loss-spike-sigma-zero", "training:\n  loss_spike:\n    sigma: 0\n", "training.loss_spike.sigma", 3, "must be > 0"),
    ("loss-spike-window-one", "training:\n  loss_spike: {window: 1, warmup: 2}\n", "training.loss_spike.window", 2,
     "must be >= 2 (a standard deviation needs two losses)"),
    ("loss-spike-warmup-over-window", "training:\n  loss_spike: {window: 10, warmup: 20}\n",
     "training.loss_spike.warmup", 2, "warmup must be <= window"),
    ("loss-spike-max-consecutive-zero", "training:\n  loss_spike:\n    max_consecutive: 0\n",
     "training.loss_spike.max_consecutive", 3, "must be > 0"),
    ("loss-spike-on-consecutive-unknown", "training:\n  loss_spike:\n    on_consecutive: restart\n",
     "training.loss_spike.on_consecutive", 3, "rollback"),
    ("loss-spike-max-rollbacks-zero", "training:\n  loss_spike:\n    max_rollbacks: 0\n",
     "training.loss_spike.max_rollbacks", 3, "must be > 0"),
    ("loss-spike-unknown-key", "training:\n  loss_spike:\n    sigmas: 4\n", "training.loss_spike.sigmas", 3,
     "did you mean 'training.loss_spike.sigma'"),
    ("loss-spike-not-mapping", "training:\n  loss_spike: 6\n", "training.loss_spike", 2,
     "expected a mapping of LossSpikeConfig keys"),
    ("stage-width-splits-microbatch", "cluster:\n  workers_per_node: 8\n  max_stage_devices: 4\ntraining:\n  microbatch_size: 2\n",
     "cluster.max_stage_devices", 3, "microbatch_size 2 is not a multiple of the stage width(s) [4]"),
    ("detection-unknown-key", "detection:\n  treshold: 3\n", "detection.treshold", 2, "did you mean 'detection.threshold'"),
    ("detection-threshold-text", "detection:\n  threshold: high\n", "detection.threshold", 2, "expected a number, got str 'high'"),
    ("detection-window-zero", "detection:\n  window: 0\n", "detection.window", 2, "must be > 0"),
    ("detection-interval-tiny", "detection:\n  interval: 0.001\n", "detection.interval", 2, "must be >= 0.1 s"),
    ("detection-continuity-below-interval", "detection:\n  interval: 2\n  continuity: 1\n", "detection.continuity", 3, "at least detection.interval (2 s)"),
    ("detection-min-nodes", "detection:\n  min_nodes: 2\n", "detection.min_nodes", 2, "must be >= 3"),
    ("detection-evict-text", "detection:\n  evict: maybe\n", "detection.evict", 2, "expected true or false"),
    ("detection-stragglers-unknown", "detection:\n  stragglers: rebalanced\n", "detection.stragglers", 2, "did you mean 'rebalance'"),
    ("detection-straggler-threshold", "detection:\n  straggler_threshold: 0.9\n", "detection.straggler_threshold", 2, "must be > 1"),
    ("detection-priority-negative", "detection:\n  priorities:\n    gpu.temp_c: -1\n", "detection.priorities", 2, "must be >= 0"),
    ("detection-priority-text", "detection:\n  priorities:\n    cpu.util: lots\n", "detection.priorities", 2, "expected a number"),
    ("detection-not-mapping", "detection: on\n", "detection", 1, "expected a mapping of DetectionConfig keys"),
    ("drill-how-unknown", "drills:\n  - {step: 5, node: node2, how: slower}\n", "drills.how", 2,
     "did you mean 'slow'"),
    ("extends-missing", "extends: centre.yaml\n", "extends", 1, "extended recipe not found"),
    ("extends-not-path", "extends: {a: 1}\n", "extends", 1, "expected a recipe path"),
]


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize(("text", "key", "line", "words"), [c[1:] for c in BAD_RECIPES], ids=[c[0] for c in BAD_RECIPES])
def test_bad_recipe_message(tmp_path: Path, text: str, key: str, line: int | None, words: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as caught:
        load_recipe(path)
    issues = [i for i in caught.value.issues if i.key == key]
    assert issues, f"no issue for key {key!r}; got: {caught.value}"
    issue = issues[0]
    assert issue.file == str(path)
    assert words in issue.message, str(issue)
    if line is not None:
        assert issue.line == line, str(issue)
        assert str(issue).startswith(f"{path}:{line}: ")


def test_at_least_thirty_distinct_cases() -> None:
    assert len({c[0] for c in BAD_RECIPES}) >= 30


def test_every_issue_is_reported_not_just_the_first(tmp_path: Path) -> None:
    path = write(tmp_path, "cluster:\n  partiton: x\ntraining:\n  microbatch_size: four\n  optimizer:\n    name: adam\n")
    with pytest.raises(RecipeError) as caught:
        load_recipe(path)
    assert [i.key for i in caught.value.issues] == ["cluster.partiton", "training.microbatch_size", "training.optimizer.name"]


def test_cycle_in_extends(tmp_path: Path) -> None:
    write(tmp_path, "extends: b.yaml\n", "a.yaml")
    write(tmp_path, "extends: a.yaml\n", "b.yaml")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")


def test_issue_in_extended_file_names_that_file(tmp_path: Path) -> None:
    write(tmp_path, "cluster:\n  nodes: 4\n  partiton: gpu\n", "centre.yaml")
    job = write(tmp_path, "extends: centre.yaml\ntraining:\n  steps: 5\n", "job.yaml")
    with pytest.raises(RecipeError) as caught:
        load_recipe(job)
    (issue,) = caught.value.issues
    assert issue.file == str(tmp_path / "centre.yaml") and issue.line == 3


@pytest.mark.parametrize(("content", "words"), [
    (b"\xff\xfe\x00bad", "not UTF-8"),
    (b"", "the recipe is empty"),
    (b"# only a comment\n\n", "the recipe is empty"),
])
def test_binary_or_empty_file(tmp_path: Path, content: bytes, words: str) -> None:
    path = tmp_path / "r.yaml"
    path.write_bytes(content)
    with pytest.raises(RecipeError, match=words) as caught:
        load_recipe(path)
    assert caught.value.issues[0].file == str(path)


def test_explicit_empty_mapping_is_all_defaults(tmp_path: Path) -> None:
    assert load_recipe(write(tmp_path, "{}\n")).cluster.nodes == 4


def test_missing_recipe_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_contradictions_are_reported_beside_unknown_keys_but_not_beside_bad_values(tmp_path: Path) -> None:
    path = write(tmp_path, "cluster:\n  nodes: 4\n  partiton: gpu\ntraining:\n  global_batch_size: 30\n")
    with pytest.raises(RecipeError) as caught:
        load_recipe(path)
    assert [i.key for i in caught.value.issues] == ["cluster.partiton", "training.microbatch_size"]
    # microbatch_size is invalid: no divisibility message about its default may appear
    path = write(tmp_path, "training:\n  global_batch_size: 30\n  microbatch_size: x\n")
    with pytest.raises(RecipeError) as caught:
        load_recipe(path)
    assert [i.message for i in caught.value.issues] == ["expected an integer, got str 'x'"]


def test_empty_section_is_all_defaults(tmp_path: Path) -> None:
    """`model:` with nothing under it once crashed the cross-checks (TypeError on None); found by fuzzing."""
    recipe = load_recipe(write(tmp_path, "name: x\nmodel:\ntraining:\n"))
    assert recipe.model.size == "tiny"


def test_the_byte_tokenizer_needs_a_vocabulary_of_256(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  size: tiny\n  vocab_size: 200\n")
    with pytest.raises(RecipeError) as caught:
        load_recipe(path)
    (issue,) = caught.value.issues
    assert issue.key == "data.tokenizer" and "vocab_size is 200" in issue.message
