"""Document masking (models/documents.py) against a per-document reference: every document of a window
run alone through the same layers, in float64. With masking, a window's logits, its loss and every
parameter's gradient are those of its documents trained one by one; the eos token's target (the next
document's first token) is kept, scored from the logits of the eos's own document."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from oobleck_slurm.models import gpt_config, llama_config
from oobleck_slurm.models.documents import Documents, run_layer
from oobleck_slurm.models.loss import lm_loss

EOS = 0
FAMILIES = {"gpt": gpt_config("tiny"), "llama": llama_config("tiny")}  # seq_len 64, byte vocabulary


def test_structure_of_a_row():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8], [EOS, 1, 2, 3, 4, 5, EOS]])
    docs = Documents.of(tokens, EOS)
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0], [0, 0, 1, 2, 3, 4, 5]]
    document = [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]  # an eos belongs to the document it ends
    for row, ids in enumerate(document):
        want = [[ids[i] == ids[j] and j <= i for j in range(7)] for i in range(7)]
        assert docs.mask[row, 0].tolist() == want
    assert docs.mask.shape == (2, 1, 7, 7) and docs.mask.dtype == torch.bool


def windows(seq_len: int, rows: int, seed: int) -> torch.Tensor:
    """`rows` consecutive windows of seq_len + 1 tokens (overlapping by one, as the data cuts them) of a
    stream of random documents of 1 to 40 tokens, each ended by the eos; the stream starts inside a
    document, so the first window's first document began before it, and later windows start inside one."""
    rng = np.random.default_rng(seed)
    stream: list[int] = list(rng.integers(1, 256, 7))  # the tail of a document begun earlier
    while len(stream) < rows * seq_len + 1:
        stream += list(rng.integers(1, 256, int(rng.integers(1, 41)))) + [EOS]
    tokens = torch.tensor(stream, dtype=torch.int64)
    return torch.stack([tokens[r * seq_len : r * seq_len + seq_len + 1] for r in range(rows)])


def segments(row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document of a row of input tokens: each ends after its eos, or at the row's end."""
    cuts = [0] + [i + 1 for i in (row == EOS).nonzero().flatten().tolist()]
    ends = cuts[1:] + [len(row)]
    return [(a, b) for a, b in zip(cuts, ends) if a < b]


def forward(layers: list[torch.nn.Module], x: torch.Tensor, documents: Documents | None) -> torch.Tensor:
    h = x
    for layer in layers:
        h = run_layer(layer, h, documents)
    return h


@pytest.mark.parametrize("family", FAMILIES)
def test_a_masked_window_is_its_documents_run_alone(family):
    cfg = FAMILIES[family]
    layers = [layer.double() for layer in cfg.build_layers(seed=3, start=0, stop=cfg.num_layers)]
    params = [p for layer in layers for p in layer.parameters()]
    w = windows(cfg.seq_len, rows=4, seed=1)
    x, y = w[:, :-1], w[:, 1:]
    # windows whose first document began in the window before (row 0: the stream's first, cut document)
    spanning = [r for r in range(4) if r == 0 or x[r - 1, -1] != EOS]
    assert len(spanning) >= 3 and all(len(segments(row)) >= 3 for row in x)  # several documents per window

    logits = forward(layers, x, Documents.of(x, EOS))
    loss = lm_loss(logits, y)
    grads = torch.autograd.grad(loss, params)

    # the reference: each document alone (the plain causal model, positions from 0), every target of
    # the window scored once from its own document's logits, summed over the window's b * t targets
    total = torch.zeros((), dtype=torch.float64)
    alone = torch.empty_like(logits)
    boundary_targets = 0
    for r in range(x.shape[0]):
        for a, b in segments(x[r]):
            out = forward(layers, x[r : r + 1, a:b], None)
            alone[r, a:b] = out[0].detach()
            total = total + F.cross_entropy(out[0], y[r, a:b], reduction="sum")
            boundary_targets += int(x[r, b - 1] == EOS)  # the eos predicts the next document's first token
    reference = total / y.numel()
    ref_grads = torch.autograd.grad(reference, params)

    assert boundary_targets >= 8  # the kept targets across a boundary are in both sums
    assert torch.allclose(logits.detach(), alone, rtol=0, atol=1e-12)
    assert abs(loss.item() - reference.item()) <= 1e-12 * abs(reference.item())
    for g, ref in zip(grads, ref_grads):
        assert float((g - ref).abs().max()) <= 1e-12 * max(1.0, float(ref.abs().max()))
    # without masking the same window gives other logits (the comparison can fail)
    assert not torch.allclose(forward(layers, x, None).detach(), alone, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_window_of_one_document_is_the_plain_causal_model(family):
    cfg = FAMILIES[family]
    layers = [layer.double() for layer in cfg.build_layers(seed=3, start=0, stop=cfg.num_layers)]
    x = torch.randint(1, 256, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        masked, plain = forward(layers, x, Documents.of(x, EOS)), forward(layers, x, None)
    assert torch.allclose(masked, plain, rtol=0, atol=1e-12)
