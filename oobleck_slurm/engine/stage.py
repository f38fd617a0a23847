"""One pipeline stage: forward and backward of its contiguous layers for one microbatch at a time.

For the step's last microbatch (`split`), each layer's input is detached at the layer boundary and
backward runs one layer at a time from the last to the first: the arithmetic is the same as one
autograd pass over the stage, but the caller learns the moment a layer's gradient is complete and can
start that layer's all-reduce while earlier layers are still in backward. Other microbatches run one
autograd pass over the stage (one backward call, not one per layer).

A sharded stage (`params`, shard.py) runs every microbatch layer by layer, each layer's use framed by
`params.before` / `params.after` (its gathers, and when resharded its gradient's reduce-scatter).

Random layers (`draws`, layer_rng.py): each layer's forward of a microbatch runs with the generators
seeded from (seed, step, the microbatch's number in the step, the layer's index), so dropout masks do
not depend on the plan; on a sharded stage a layer that draws is refused (`names` name it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from oobleck_slurm.engine.layer_rng import LayerDraws
from oobleck_slurm.engine.shard import StageParams
from oobleck_slurm.models.documents import Documents, run_layer


class Stage:
    def __init__(self, layers: list[nn.Module], first_layer: int, is_last: bool, device: torch.device,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], bf16: bool = False,
                 recompute: bool = False, params: StageParams | None = None, draws: LayerDraws | None = None,
                 names: list[str] | None = None) -> None:
        self.layers = layers
        self.params = params
        self.draws = draws
        self.names = names or [str(first_layer + i) for i in range(len(layers))]
        self.loss = loss
        # Recompute: a layer's forward keeps only its input; its backward runs the forward again (under
        # the same autocast) to rebuild what it needs.
        self.recompute = recompute
        self.first_layer = first_layer
        self.is_last = is_last
        self.device = device
        # bf16: autocast on the worker's device (CUDA; also CPU, where the path is tested), parameters,
        # gradients and optimizer state stay in their own dtype (fp32 master weights).
        self.bf16 = bf16
        self.boundary_dtype = next((p.dtype for layer in layers for p in layer.parameters()), torch.float32)
        # microbatch -> [(layer input, layer output)], the last output being the scaled loss on the
        # last stage; freed by backward.
        self._saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None,
                loss_scale: float = 1.0, split: bool = True, documents: Documents | None = None,
                microbatch: int | None = None) -> torch.Tensor:
        """The stage's output for microbatch `mb` (detached), or on the last stage its scaled loss.
        `split`: layer by layer, so that backward can report each layer as it completes. `documents`:
        the microbatch's document structure, given to every layer (document masking). `microbatch`: its
        number in the whole step (default `mb`), which seeds the layers' random draws."""
        microbatch = mb if microbatch is None else microbatch
        saved = []
        h = x
        split = split or self.params is not None
        with self._autocast():
            for index in range(len(self.layers)):
                if self.params is not None:
                    self.params.before(index, 1)
                if split or index == 0:
                    inp = h.detach().requires_grad_(h.is_floating_point())
                    h = self._run(index, inp, documents, microbatch)
                    saved.append((inp, h))
                else:
                    h = self._run(index, h, documents, microbatch)
                    saved[-1] = (saved[-1][0], h)
                if self.params is not None:
                    self.params.after(index, 1)
            if self.is_last:
                if targets is None:
                    raise ValueError("Stage.forward: the last stage needs the targets")
                h = self.loss(h, targets) * loss_scale
                saved[-1] = (saved[-1][0], h)
        self._saved[mb] = saved
        # What crosses a stage boundary has the parameters' dtype (the receiver's buffer): under
        # autocast a block may return bf16; its backward casts the incoming gradient back.
        return h.detach() if self.is_last else h.detach().to(self.boundary_dtype)

    def _run(self, index: int, x: torch.Tensor, documents: Documents | None, microbatch: int) -> torch.Tensor:
        layer = self.layers[index]
        seeded = (contextlib.nullcontext() if self.draws is None else
                  self.draws.seeded(microbatch, self.first_layer + index,
                                    check=self.names[index] if self.params is not None else None))
        with seeded:
            if self.recompute and torch.is_grad_enabled():
                # the recomputation in the backward runs with the same documents (kept with the inputs),
                # and the same random draws (checkpoint restores the generators' state it found: seeded)
                return checkpoint(run_layer, layer, x, documents, use_reentrant=False)
            return run_layer(layer, x, documents)

    def backward(self, mb: int, grad_out: torch.Tensor | None,
                 on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """Backward of microbatch `mb`; returns the gradient of the stage input (None for token ids).

        `on_layer_done(layer_index)` is called as soon as each layer's backward is done, last
        layer first.
        """
        saved = self._saved.pop(mb)
        if on_layer_done is not None and len(saved) != len(self.layers):
            raise RuntimeError(f"microbatch {mb} ran as one pass: its layers' completion cannot be reported")
        grad = grad_out
        for i in range(len(saved) - 1, -1, -1):
            inp, out = saved[i]
            if self.params is not None:
                self.params.before(i, -1)
            if grad is None:  # the loss
                out.backward()
            else:
                out.backward(grad)
            if self.params is not None:
                self.params.after(i, -1)
            grad = inp.grad if inp.requires_grad else None
            if on_layer_done is not None:
                on_layer_done(self.first_layer + i)
        return grad

    @property
    def in_flight(self) -> int:
        return len(self._saved)
