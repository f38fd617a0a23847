"""A layer sharded across the g ranks of a wide stage, ZeRO-3 style, by the engine itself.

Layout (pure, `padded` / `shard_range` / `piece_range`): a layer's parameters, in `parameters()` order,
form one flat buffer of n elements, padded with zeros to C = n rounded up to SHARD_ALIGN. Shard j of
width g is [j C/g, (j+1) C/g): since widths are powers of two up to SHARD_ALIGN, the shards of a
narrower stage are unions of a wider stage's, so a layer held at different widths by different
pipelines is all-reduced in pieces at the widest holder's boundaries (layout.reduce_pieces), each
piece held whole by one rank per pipeline. Logical ranges are clipped to n: the padding is storage
only, never reduced, sent or normed.

What a rank holds (`ShardedLayer`): its parameter shard (the master copy), the layer module whose
parameters are views into a full-size buffer that is allocated only while gathered (its storage is
resized to 0 otherwise, as FSDP does), a full-size gradient buffer (the module's `.grad` views,
allocated the same way), the gradient shard, and an optimizer over the shard: one parameter per
(original parameter, shard) overlap, views into the shard, weight decay as the original parameter's
(matrices only). AdamW is elementwise, so stepping the pieces is the same arithmetic as stepping the
whole layer. CAME (optim/came_sharded.py) steps one piece per original parameter, empty where the rank
holds none of it: its row/column statistics and update RMS come from partial sums all-reduced in the
stage group (`ShardedCAME.prepare`, which the worker runs before its step's commit point), the row and
column vectors are whole on every rank of the stage, the first moment (and a vector's second moment)
is sharded like the parameter.

Optimizer state in flat form (checkpoints, copies between widths): the elementwise moments `MOMENTS`
over the layer's flat buffer (or a shard of it), the step counter, and CAME's row/column statistics of
the layer's matrices as one whole buffer (`FACTORED_KEYS` per matrix, in module order; empty for AdamW).

When (`StageParams`), in the stage's mode (planning/cost.py: the planner keeps a stage where it fits):
- kept: a layer's parameters are all-gathered inside the stage group before its first forward of the
  step (the next layer's gather posted first) and kept until the step's schedule ends; gradients
  accumulate at full size over the step's microbatches and are reduce-scattered once, when the last
  microbatch's backward has passed the layer.
- resharded (ZeRO-3): the parameters are gathered before each forward and again before each backward,
  and freed after each use, so a rank never holds more than two layers' full parameters (the current
  and the prefetched next); each microbatch's gradient of a layer exists in full from that layer's
  backward until the next layer's backward is done: its reduce-scatter is posted after its backward and
  waited for behind the next one (the scatter overlaps that compute), then added to the rank's gradient
  shard.
Each shard's pieces are then all-reduced across the pipelines. Every collective is posted by the engine
on its own groups and waited on through the generation's abortable waits.

Buckets (kept): consecutive layers go as one collective, as DDP buckets its all-reduces, up to
`training.bucket_mb` of full-size buffer per bucket: one all-gather and one reduce-scatter per bucket
instead of per layer, the layers' shards side by side in a flat buffer (rank-major: chunk j holds every
layer's shard j), copied in before and out after (`BucketWork`). The first layer to run is a bucket of
its own, so that its forward waits for its gather alone; a layer of at least the cap is always alone, as
are a model's large layers on GPUs, where nothing is copied. What a collective costs on top of its bytes
is why: gloo's reduce-scatter takes ~20 ms of 4 CPU ranks' time a call, whatever its size.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from oobleck_slurm.engine.comm import Group
from oobleck_slurm.engine.layout import SHARD_ALIGN
from oobleck_slurm.engine.spec import OptimSpec
from oobleck_slurm.optim import load_optimizer_state_tensors, optimizer_state_spec, optimizer_state_tensors
from oobleck_slurm.optim.build import build_optimizer, came_betas_eps
from oobleck_slurm.optim.came_sharded import FACTORED_KEYS, CamePiece, ShardedCAME, factored_sizes

# Elementwise state, sharded like the parameters: AdamW's two moments; CAME's first moment and the
# second moment of its parameters of fewer than two dimensions (zero over the matrices' elements).
MOMENTS = ("exp_avg", "exp_avg_sq")


def bucket_runs(nbytes: list[int], cap: float, first_alone: bool) -> list[list[int]]:
    """Positions 0..len-1 (layers in the order their collectives are posted, of `nbytes` full-size bytes
    each) cut into runs of consecutive positions: a run closes once it holds `cap` bytes or more; with
    `first_alone`, position 0 is a run of its own (module doc, buckets)."""
    runs: list[list[int]] = []
    run: list[int] = []
    total = 0.0
    for pos, size in enumerate(nbytes):
        run.append(pos)
        total += size
        if total >= cap or (first_alone and pos == 0):
            runs.append(run)
            run, total = [], 0.0
    if run:
        runs.append(run)
    return runs


def padded(n: int) -> int:
    """The flat buffer's length once padded: every width's shards are equal and nest."""
    return -(-n // SHARD_ALIGN) * SHARD_ALIGN


def shard_range(n: int, width: int, index: int) -> tuple[int, int]:
    """The logical elements [lo, hi) of a flat buffer of n that shard `index` of `width` holds."""
    size = padded(n) // width
    return min(n, index * size), min(n, (index + 1) * size)


def piece_range(n: int, pieces: int, piece: int) -> tuple[int, int]:
    """Logical elements of piece `piece` of `pieces` (the shards of the widest holder)."""
    return shard_range(n, pieces, piece)


def param_offsets(module: nn.Module) -> dict[int, tuple[int, int]]:
    """id(parameter) -> (offset, numel) in the layer's flat buffer (`parameters()` order)."""
    out, offset = {}, 0
    for p in module.parameters():
        out[id(p)] = (offset, p.numel())
        offset += p.numel()
    return out


def flat_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def factored_numel(shapes: list[tuple[int, ...]]) -> int:
    """Entries of CAME's row/column statistics of a layer whose parameters have `shapes`."""
    return sum(2 * sum(factored_sizes(shape)) for shape in shapes if len(shape) >= 2)


def param_spans(shapes: list[tuple[int, ...]], lo: int, hi: int, vectors_only: bool = False) -> list[tuple[int, int]]:
    """The logical elements [lo, hi) of a layer whose parameters have `shapes`, cut at its parameters'
    boundaries (only those of fewer than two dimensions with `vectors_only`): what a plan change sends
    as one message each, so that every piece is a view of one live tensor on both ends."""
    out, offset = [], 0
    for shape in shapes:
        k = math.prod(shape)
        a, b = max(lo, offset), min(hi, offset + k)
        if a < b and (len(shape) < 2 or not vectors_only):
            out.append((a, b))
        offset += k
    return out


def vector_spans(shapes: list[tuple[int, ...]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The logical elements of [lo, hi) that belong to parameters of fewer than two dimensions, as
    ranges: where CAME keeps an elementwise second moment (a copy moves no zeros of the matrices')."""
    return param_spans(shapes, lo, hi, vectors_only=True)


# A holding's tensors as views of the live ones, for a plan change's sends: by key ("params", then the
# MOMENTS), (first logical element, end, flat view) pieces, none crossing a parameter's boundary.
FlatViews = dict[str, list[tuple[int, int, torch.Tensor]]]


def view_of(views: FlatViews, key: str, lo: int, hi: int) -> torch.Tensor:
    """Logical elements [lo, hi) of `key` (within one parameter) as a view of the tensor holding them."""
    for a, b, t in views[key]:
        if a <= lo and hi <= b:
            return t[lo - a : hi - a]
    raise RuntimeError(f"no held {key} covers the elements [{lo}, {hi})")


def layer_views(module: nn.Module, opt: torch.optim.Optimizer) -> FlatViews:
    """A whole layer's parameters and elementwise moments as views of its live tensors (FlatViews);
    a moment the optimizer keeps none of (CAME's matrices' second moment) has no piece there."""
    offsets = param_offsets(module)
    named = optimizer_state_tensors(opt)
    out: FlatViews = {"params": [], **{key: [] for key in MOMENTS}}
    for p in module.parameters():
        off, k = offsets[id(p)]
        out["params"].append((off, off + k, p.detach().reshape(-1)))  # a view: parameters are contiguous
    for i, q in enumerate(_optimizer_params(opt)):
        off, k = offsets[id(q)]
        for key in MOMENTS:
            if (name := f"{i}.{key}") in named:
                out[key].append((off, off + k, named[name].reshape(-1)))
    return out


def _optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def flat_state(module: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], torch.Tensor,
                                                                       torch.Tensor]:
    """A whole layer's optimizer state in flat form (module doc): the moments as flat buffers of n, the
    step counter, and CAME's row/column statistics."""
    n = flat_numel(module)
    offsets = param_offsets(module)
    named = optimizer_state_tensors(opt)
    params = _optimizer_params(opt)
    out = {key: torch.zeros(n, dtype=params[0].dtype, device=params[0].device) for key in MOMENTS}
    step = named["0.step"].clone()
    for i, p in enumerate(params):
        off, k = offsets[id(p)]
        for key in MOMENTS:
            if f"{i}.{key}" in named:  # CAME: no second moment of a matrix
                out[key][off : off + k] = named[f"{i}.{key}"].reshape(-1)
    return out, step, layer_factored(module, opt)


def layer_factored(module: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """A whole layer's CAME row/column statistics as one buffer (module doc); empty for AdamW."""
    named = optimizer_state_tensors(opt)
    params = _optimizer_params(opt)
    index = {id(p): i for i, p in enumerate(params)}
    factored = [named[name].reshape(-1) for p in module.parameters() for key in FACTORED_KEYS
                if (name := f"{index[id(p)]}.{key}") in named]
    empty = torch.zeros(0, dtype=params[0].dtype, device=params[0].device)
    return torch.cat(factored) if factored else empty


# Where each state tensor of a whole layer's optimizer lies in flat form: name -> (source, offset, shape),
# the source "step", a MOMENTS key (offset in the layer's flat buffer) or "factored" (offset in the
# row/column statistics), in the optimizer's order of names.
StateLayout = dict[str, tuple[str, int, tuple[int, ...]]]


def state_layout(module: nn.Module, opt: torch.optim.Optimizer) -> StateLayout:
    """The flat form's map of a whole layer's optimizer `opt` (StateLayout), from its parameters alone:
    the optimizer needs no state yet."""
    offsets = param_offsets(module)
    spec = optimizer_state_spec(opt)
    params = _optimizer_params(opt)
    where: StateLayout = {}
    for i, p in enumerate(params):
        off, _ = offsets[id(p)]
        where[f"{i}.step"] = ("step", 0, spec[f"{i}.step"][0])
        for key in MOMENTS:
            if (name := f"{i}.{key}") in spec:
                where[name] = (key, off, tuple(p.shape))
    index, pos = {id(p): i for i, p in enumerate(params)}, 0
    for p in module.parameters():
        for key in FACTORED_KEYS:
            if (name := f"{index[id(p)]}.{key}") in spec:
                shape = spec[name][0]
                where[name] = ("factored", pos, shape)
                pos += math.prod(shape)
    if unknown := [name for name in spec if name not in where]:
        raise RuntimeError(f"optimizer state {unknown[:5]} has no flat form (shard.py MOMENTS, FACTORED_KEYS)")
    return {name: where[name] for name in spec}


def factored_count(layout: StateLayout) -> int:
    """Entries of the row/column statistics a StateLayout names."""
    return sum(math.prod(shape) for source, _, shape in layout.values() if source == "factored")


def load_flat_state(module: nn.Module, opt: torch.optim.Optimizer, moments: dict[str, torch.Tensor],
                    step: torch.Tensor, factored: torch.Tensor) -> None:
    """The inverse of `flat_state`: a whole layer's optimizer from flat moments (length >= n), a step
    and CAME's row/column statistics (empty for AdamW)."""
    layout = state_layout(module, opt)
    if (need := factored_count(layout)) != factored.numel():
        raise ValueError(f"CAME's row/column statistics: got {factored.numel()} values, the layer's "
                         f"matrices have {need}")
    step = step_like(opt, step)
    tensors: dict[str, torch.Tensor] = {}
    for name, (source, offset, shape) in layout.items():
        if source == "step":
            tensors[name] = step
        else:
            flat = factored if source == "factored" else moments[source]
            tensors[name] = flat[offset : offset + math.prod(shape)].view(shape)
    load_optimizer_state_tensors(opt, tensors)


def step_like(opt: torch.optim.Optimizer, step: torch.Tensor) -> torch.Tensor:
    """A step counter in the dtype, shape and device the optimizer keeps it in (it crosses processes
    as a 1-element tensor of the parameters' dtype)."""
    shape, dtype, device = optimizer_state_spec(opt)["0.step"]
    return step.reshape(shape).to(dtype=dtype, device=device)


class ShardedLayer:
    """Rank `index` of `width`'s share of one layer (module doc). `module` is the whole layer as built
    (its values are the layer's parameters); the shard is cut from it and its buffer then freed."""

    def __init__(self, module: nn.Module, width: int, index: int, spec: OptimSpec) -> None:
        params = list(module.parameters())
        self.module, self.width, self.index = module, width, index
        self.n = flat_numel(module)
        self.size = padded(self.n) // width
        self.base = index * self.size  # the shard's first element, padded coordinates
        self.lo, self.hi = shard_range(self.n, width, index)
        dtype, device = params[0].dtype, params[0].device
        # The `.grad` views first, their storage freed at once (a step allocates it, open_grad): the
        # layer as built and its full buffer are then the only whole copies at a time (a plan change
        # installs layers beside the old state).
        self.grad_full = torch.empty(padded(self.n), dtype=dtype, device=device)
        offset = 0
        for p in params:
            p.grad = self.grad_full[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.release_grad()
        self.full = torch.zeros(padded(self.n), dtype=dtype, device=device)
        offset = 0
        with torch.no_grad():
            for p in params:
                k = p.numel()
                self.full[offset : offset + k].copy_(p.reshape(-1))
                p.data = self.full[offset : offset + k].view_as(p)
                offset += k
        self.shard = self.full[self.base : self.base + self.size].clone()
        self.grad_shard = torch.zeros_like(self.shard)
        # AdamW: one optimizer parameter per overlap of an original parameter with the shard
        self.segments: list[tuple[int, int, nn.Parameter]] = []  # (logical lo, hi, parameter)
        # CAME: one piece per original parameter, in module order, with the parameter's flat offset
        self.pieces: list[tuple[int, CamePiece]] = []
        self.opt = self._came(params, spec) if spec.name == "came" else self._adamw(params, spec)
        self.gathered = True
        self.release()

    def _view(self, lo: int, hi: int) -> nn.Parameter:
        """An optimizer parameter over the shard's logical elements [lo, hi), its gradient the same
        elements of the gradient shard."""
        seg = nn.Parameter(self.shard[lo - self.base : hi - self.base])
        seg.grad = self.grad_shard[lo - self.base : hi - self.base]
        return seg

    def _adamw(self, params: list[nn.Parameter], spec: OptimSpec) -> torch.optim.Optimizer:
        decay: list[nn.Parameter] = []
        plain: list[nn.Parameter] = []
        offset = 0
        for p in params:
            lo, hi = max(offset, self.lo), min(offset + p.numel(), self.hi)
            if lo < hi:
                seg = self._view(lo, hi)
                self.segments.append((lo, hi, seg))
                (decay if p.dim() >= 2 else plain).append(seg)
            offset += p.numel()
        groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": plain, "weight_decay": 0.0}]
        return build_optimizer(spec.name, [g for g in groups if g["params"]], lr=spec.lr,
                               weight_decay=spec.weight_decay, betas=spec.betas, eps=spec.eps)

    def _came(self, params: list[nn.Parameter], spec: OptimSpec) -> ShardedCAME:
        """CAME over a piece of every parameter, an empty one where the shard holds none of it: every rank
        of the stage takes part in each parameter's reductions, in the same order. The hyper-parameters
        and the weight-decay rule (matrices only) of the whole layer's CAME (layer_optim.py)."""
        decay: list[CamePiece] = []
        plain: list[CamePiece] = []
        offset = 0
        for p in params:
            lo, hi = max(offset, self.lo), min(offset + p.numel(), self.hi)
            if lo >= hi:
                piece = CamePiece(self._view(self.base, self.base), tuple(p.shape), 0, 0)  # an empty view
            else:
                piece = CamePiece(self._view(lo, hi), tuple(p.shape), lo - offset, hi - offset)
            self.pieces.append((offset, piece))
            (decay if p.dim() >= 2 else plain).append(piece)
            offset += p.numel()
        groups = [{"pieces": decay, "weight_decay": spec.weight_decay}, {"pieces": plain, "weight_decay": 0.0}]
        betas, eps = came_betas_eps(spec.betas, spec.eps)
        return ShardedCAME([g for g in groups if g["pieces"]], lr=spec.lr, betas=betas, eps=eps,
                           weight_decay=spec.weight_decay)

    # ---- parameters --------------------------------------------------------------------------

    def _chunks(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t[j * self.size : (j + 1) * self.size] for j in range(self.width)]

    @property
    def nbytes(self) -> int:
        """The full-size buffer's bytes (what a bucket counts)."""
        return self.full.numel() * self.full.element_size()

    def allocate(self) -> None:
        """Allocate the full buffer again (its values are undefined until a gather fills it)."""
        storage = self.full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.nbytes)
        self.gathered = True

    def gather(self, group: Group) -> dist.Work:
        """Post the all-gather of the shards into the full buffer (allocated again first). The flat form
        (all_gather_into_tensor) writes the buffer itself: the list form made torch allocate a flat copy
        of the whole output for as long as the collective was in flight (NCCL: from its posting)."""
        self.allocate()
        return group._allgather_base(self.full, self.shard)

    def release(self) -> None:
        """Free the gathered parameters (the module's views stay, pointing at an empty storage)."""
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    # ---- gradients ---------------------------------------------------------------------------

    def begin_step(self, keep: bool) -> None:
        """A step starts: the gradient shard zeroed; kept, the whole gradient buffer allocated and zeroed
        for the step's accumulation; resharded, freed (each backward opens it, `open_grad`)."""
        self.grad_shard.zero_()
        if keep:
            self.open_grad()
        else:
            self.release_grad()

    def open_grad(self) -> None:
        """Allocate the whole gradient buffer (the `.grad` views) and zero it."""
        storage = self.grad_full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.grad_full.numel() * self.grad_full.element_size())
        self.grad_full.zero_()

    def release_grad(self) -> None:
        self.grad_full.untyped_storage().resize_(0)

    def reduce_scatter(self, group: Group) -> dist.Work:
        """Post the SUM reduce-scatter of the stage's full gradients into this rank's shard (kept: once
        per step), in the flat form (reduce_scatter_tensor): the list form copies the input into a flat
        buffer of its own first."""
        return group._reduce_scatter_base(self.grad_shard, self.grad_full, dist.ReduceScatterOptions())

    def scatter_microbatch(self, group: Group, by_allreduce: bool) -> tuple[dist.Work, Callable[[], None]]:
        """Resharded: post the reduce-scatter of one microbatch's whole gradient; the returned function,
        once the work is done, adds it to the shard and frees the whole gradient. `by_allreduce`
        (comm.SCATTER_BY_ALLREDUCE): as an all-reduce of the whole gradient in place, of which the rank
        keeps its chunk (the gradient is freed right after). The scatter's own buffer (one gradient
        shard) lives only while it is in flight: the function frees it with the whole gradient (kept
        stages never scatter this way, and the planner counts one gradient shard per layer, besides the
        whole gradients of the scatters in flight)."""
        scattered: torch.Tensor | None = None
        if by_allreduce:
            work = group.allreduce([self.grad_full])
        else:
            scattered = torch.empty_like(self.grad_shard)
            work = group._reduce_scatter_base(scattered, self.grad_full, dist.ReduceScatterOptions())

        def unpack() -> None:
            nonlocal scattered
            if by_allreduce:
                self.grad_shard += self._chunks(self.grad_full)[self.index]
            else:
                assert scattered is not None, "a microbatch's scatter unpacked twice"
                self.grad_shard += scattered
                scattered = None
            self.release_grad()

        return work, unpack

    def grad_view(self, lo: int, hi: int) -> torch.Tensor:
        """The reduced gradient's logical elements [lo, hi), inside this shard."""
        return self.grad_shard[lo - self.base : hi - self.base]

    # ---- optimizer state as flat shards (checkpoints, copies between widths) -------------------

    def state_shards(self) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """The shard's optimizer state in flat form (module doc): the moments as buffers of the shard's
        size (zero where there is none: padding, CAME's matrices' second moment), the step, and CAME's
        row/column statistics (whole; empty for AdamW)."""
        return {key: self.state_shard(key) for key in MOMENTS}, self.state_step(), self.state_factored()

    def state_shard(self, key: str) -> torch.Tensor:
        """Moment `key` (of MOMENTS) of the shard in flat form: a buffer of the shard's size."""
        out = torch.zeros_like(self.shard)
        for lo, hi, t in self.state_views()[key]:
            out[lo - self.base : hi - self.base] = t
        return out

    def state_step(self) -> torch.Tensor:
        """The optimizer's step counter (a copy)."""
        if isinstance(self.opt, ShardedCAME):
            return self.opt.state[self.pieces[0][1].param]["step"].clone()
        return optimizer_state_tensors(self.opt)["0.step"].clone()

    def state_factored(self) -> torch.Tensor:
        """CAME's row/column statistics of the layer's matrices, whole, as one buffer; empty for AdamW."""
        if not isinstance(self.opt, ShardedCAME):
            return self.shard.new_zeros(0)
        factored = [state[key] for _, piece in self.pieces
                    for key in FACTORED_KEYS if key in (state := self.opt.state[piece.param])]
        return torch.cat(factored) if factored else self.shard.new_zeros(0)

    def state_views(self) -> FlatViews:
        """The shard's parameters and elementwise moments as views of its live tensors (FlatViews)."""
        out: FlatViews = {"params": [(self.lo, self.hi, self.shard[: self.hi - self.lo])],
                          **{key: [] for key in MOMENTS}}
        if isinstance(self.opt, ShardedCAME):
            for offset, piece in self.pieces:
                state = self.opt.state[piece.param]
                for key in MOMENTS:
                    if key in state and piece.lo < piece.hi:
                        out[key].append((offset + piece.lo, offset + piece.hi, state[key].reshape(-1)))
            return out
        named = optimizer_state_tensors(self.opt)
        for i, p in enumerate(_optimizer_params(self.opt)):
            lo, hi = self._segment_range(p)
            for key in MOMENTS:
                out[key].append((lo, hi, named[f"{i}.{key}"].reshape(-1)))
        return out

    def load_state_shards(self, moments: dict[str, torch.Tensor], step: torch.Tensor, factored: torch.Tensor) -> None:
        """The inverse of `state_shards` (moments of at least the shard's size)."""
        if isinstance(self.opt, ShardedCAME):
            self._load_came(moments, step, factored)
            return
        tensors: dict[str, torch.Tensor] = {}
        step = step_like(self.opt, step)
        for i, p in enumerate(_optimizer_params(self.opt)):
            lo, hi = self._segment_range(p)
            tensors[f"{i}.step"] = step
            for key in MOMENTS:
                tensors[f"{i}.{key}"] = moments[key][lo - self.base : hi - self.base]
        load_optimizer_state_tensors(self.opt, tensors)

    def _load_came(self, moments: dict[str, torch.Tensor], step: torch.Tensor, factored: torch.Tensor) -> None:
        count = int(round(float(step)))  # it may cross processes as a float of the parameters' dtype
        pos = 0
        for offset, piece in self.pieces:
            state = self.opt.state[piece.param]
            state["step"].fill_(count)
            for key in MOMENTS:
                if key in state and piece.lo < piece.hi:
                    state[key].copy_(moments[key][offset + piece.lo - self.base : offset + piece.hi - self.base])
            for key in FACTORED_KEYS:
                if key in state:
                    k = state[key].numel()
                    if pos + k > factored.numel():
                        raise ValueError(f"CAME's row/column statistics: got {factored.numel()} values, "
                                         f"the layer's matrices have more")
                    state[key].copy_(factored[pos : pos + k])
                    pos += k
        if pos != factored.numel():
            raise ValueError(f"CAME's row/column statistics: got {factored.numel()} values, the layer's "
                             f"matrices have {pos}")

    def _segment_range(self, p: torch.Tensor) -> tuple[int, int]:
        for lo, hi, seg in self.segments:
            if seg is p:
                return lo, hi
        raise RuntimeError("an optimizer parameter that is no segment of the shard")


class BucketWork:
    """One collective over a bucket of a stage's layers (positions in the stage) and the copy out of its
    flat buffer that completes it (`complete`, once; nothing to copy for a bucket of one layer)."""

    def __init__(self, positions: list[int], work: dist.Work, unpack: Callable[[], None] | None) -> None:
        self.positions, self.work, self.unpack = positions, work, unpack
        self.done = False

    def complete(self, wait: Callable[[dist.Work], None]) -> None:
        if not self.done:
            wait(self.work)
            if self.unpack is not None:
                self.unpack()
            self.done = True


def gather_bucket(layers: list[ShardedLayer], positions: list[int], group: Group) -> BucketWork:
    """Post one all-gather of the layers' shards into their full buffers. A bucket of several layers
    gathers into a buffer of its own; the layers' full buffers are allocated only as it is unpacked, so
    a kept stage that posts all its buckets at once holds its gathered layers once, plus one bucket."""
    if len(positions) == 1:
        return BucketWork(positions, layers[positions[0]].gather(group), None)
    members = [layers[p] for p in positions]
    width, index = members[0].width, members[0].index
    total = sum(layer.size for layer in members)
    recv = members[0].shard.new_empty(width * total)
    send = recv[index * total : (index + 1) * total]  # in place: this rank's chunk is its input
    torch.cat([layer.shard for layer in members], out=send)
    work = group._allgather_base(recv, send)

    def unpack() -> None:
        rows, offset = recv.view(width, -1), 0
        for layer in members:
            layer.allocate()
            layer.full.view(width, layer.size).copy_(rows[:, offset : offset + layer.size])
            offset += layer.size

    return BucketWork(positions, work, unpack)


def reduce_scatter_bucket(layers: list[ShardedLayer], positions: list[int], group: Group,
                          by_allreduce: bool) -> BucketWork:
    """Post one SUM reduce-scatter of the layers' full gradients into their gradient shards (kept: once
    per step, when the gradients are final). `by_allreduce` (comm.SCATTER_BY_ALLREDUCE): as an all-reduce
    of the whole gradients, in place, of which each rank keeps its shard."""
    members = [layers[p] for p in positions]  # in the order given: their pieces are reduced in it
    width, index = members[0].width, members[0].index
    if len(members) == 1 and not by_allreduce:
        return BucketWork(positions, members[0].reduce_scatter(group), None)
    if len(members) == 1:
        flat = members[0].grad_full.view(width, -1)
    else:
        flat = torch.cat([layer.grad_full.view(width, layer.size) for layer in members], dim=1)  # rank-major
    mine = flat[index] if by_allreduce else flat.new_empty(flat.shape[1])
    work = (group.allreduce([flat]) if by_allreduce
            else group._reduce_scatter_base(mine, flat.view(-1), dist.ReduceScatterOptions()))

    def unpack() -> None:
        offset = 0
        for layer in members:
            layer.grad_shard.copy_(mine[offset : offset + layer.size])
            offset += layer.size

    return BucketWork(positions, work, unpack)


class StageParams:
    """Gathers a wide stage's layers around their use, in the stage's mode (module doc): `before(i, d)`
    makes layer i's parameters whole for a forward (d = 1) or a backward (d = -1), `after(i, d)` ends
    that use. Kept: the step's first use posts every layer's gather, in buckets; `scatter(i)`, as the
    step's gradient of layer i is complete (the stage's last layer first), returns the reduce-scatter
    of its bucket once the bucket is complete. Resharded: one layer at a time, the gather of layer
    i + d (the next to run) posted first. Every rank of the stage runs the same sequence, so the stage
    group's collectives match."""

    def __init__(self, layers: list[ShardedLayer], group: Group, wait: Callable[[dist.Work], None],
                 keep: bool, bucket_bytes: float, scatter_by_allreduce: bool) -> None:
        self.layers, self.group, self.wait, self.keep = layers, group, wait, keep
        self.bucket_bytes, self.scatter_by_allreduce = bucket_bytes, scatter_by_allreduce
        self.pending: dict[int, BucketWork] = {}  # position -> the gather in flight that holds it
        # resharded: position -> its microbatch's reduce-scatter in flight, completed behind the next
        # layer's backward (`after`), before the layer's own next backward (`before`), or at `finish`
        self.scattering: dict[int, BucketWork] = {}
        self.whole: set[int] = set()  # kept: layers gathered this step
        # kept: the reduce-scatter buckets, from the stage's last layer down, by the layer that closes each
        down = list(reversed(range(len(layers))))
        runs = bucket_runs([layers[p].nbytes for p in down], bucket_bytes, first_alone=False)
        self.closes = {down[run[-1]] for run in runs}
        self.filling: list[int] = []  # kept: layers whose step gradient is complete, not yet scattered

    def _post(self, positions: list[int]) -> None:
        work = gather_bucket(self.layers, positions, self.group)
        for p in positions:
            self.pending[p] = work

    def before(self, i: int, direction: int) -> None:
        if self.keep:
            if not self.whole and not self.pending:  # the step's first use: every gather, in buckets
                order = list(range(len(self.layers)))[::direction]
                for run in bucket_runs([self.layers[p].nbytes for p in order], self.bucket_bytes, first_alone=True):
                    self._post([order[k] for k in run])
        else:
            for j in (i, i + direction):
                if 0 <= j < len(self.layers) and j not in self.pending:
                    self._post([j])
        work = self.pending.get(i)
        if work is not None:
            work.complete(self.wait)
            for p in work.positions:
                del self.pending[p]
                if self.keep:
                    self.whole.add(p)
        if not self.keep and direction < 0:
            self.complete_scatter(i)  # its whole gradient is about to be zeroed for this backward
            self.layers[i].open_grad()

    def after(self, i: int, direction: int) -> None:
        if self.keep:
            return
        if direction < 0:
            # post this layer's scatter, then complete the ones posted before it: they ran behind this
            # layer's backward (one more layer's whole gradient held, planning/cost.py stage_memory)
            work, unpack = self.layers[i].scatter_microbatch(self.group, self.scatter_by_allreduce)
            for j in list(self.scattering):
                self.complete_scatter(j)
            self.scattering[i] = BucketWork([i], work, unpack)
        if i not in self.pending:  # a prefetched gather is kept
            self.layers[i].release()

    def complete_scatter(self, i: int) -> None:
        """Resharded: wait for layer i's reduce-scatter in flight, if any, and add it to its shard."""
        work = self.scattering.pop(i, None)
        if work is not None:
            work.complete(self.wait)

    def scattered(self, i: int) -> BucketWork | None:
        """Resharded: layer i's reduce-scatter still in flight (its shard is final once it completes)."""
        return self.scattering.get(i)

    def scatter(self, i: int) -> BucketWork | None:
        """Kept: layer i's gradient for the step is complete. The reduce-scatter of its bucket, posted,
        once i closes the bucket; else None (it goes with the bucket's later layers)."""
        self.filling.append(i)
        if i not in self.closes:
            return None
        work = reduce_scatter_bucket(self.layers, self.filling, self.group, self.scatter_by_allreduce)
        self.filling = []
        return work

    def finish(self) -> None:
        """Wait for a prefetch nobody used and the scatters in flight, and free everything (end of a
        schedule)."""
        for work in {id(w): w for w in self.pending.values()}.values():
            work.complete(self.wait)
        self.pending.clear()
        for i in list(self.scattering):
            self.complete_scatter(i)
        for layer in self.layers:
            layer.release()
        self.whole.clear()


# ---- copies between replicas of different widths (recovery) ----------------------------------------

Holding = tuple[int, int]  # (width, index): a rank holds shard `index` of `width` of a layer
Move = tuple[int, int, int, int, int]  # (layer, src rank, dst rank, first part, end part)
PARTS = SHARD_ALIGN  # a layer's padded buffer in parts: shard j of width g is parts [j P/g, (j+1) P/g)


def part_range(width: int, index: int) -> tuple[int, int]:
    return index * PARTS // width, (index + 1) * PARTS // width


def parts_to_elements(n: int, lo: int, hi: int) -> tuple[int, int]:
    """Parts [lo, hi) of a layer of n elements as logical elements (clipped to n: maybe empty)."""
    size = padded(n) // PARTS
    return min(n, lo * size), min(n, hi * size)


def _replica(holdings: dict[int, dict[int, Holding]], rank: int, layer: int) -> tuple[int, ...] | None:
    """The ranks holding together the whole of `layer` with `rank` (its stage in the plan it was held
    under: consecutive workers of one node, whose order a new generation keeps), if all of them do."""
    held = holdings.get(rank, {}).get(layer)
    if held is None:
        return None
    width, index = held
    ranks = tuple(rank - index + k for k in range(width))
    if any(holdings.get(r, {}).get(layer) != (width, k) for k, r in enumerate(ranks)):
        return None
    return ranks


def slice_moves(stages: list[tuple[tuple[int, ...], range]], holdings: dict[int, dict[int, Holding]],
                transfers: list[tuple[int, int, int]]) -> list[Move]:
    """The copies that give every rank of the new plan's `stages` [(ranks, layers)] its shard of each
    of its layers, as part ranges from holders (`holdings`: what each rank holds now, any width).

    A rank whose holding covers its new shard keeps it (a move to itself). Otherwise its shard comes
    from one whole replica: the one of the coordinator's sender for that layer and stage (`transfers`
    [(layer, src, dst)], dst any rank of the stage), else the one this rank or its stage already belongs
    to (a change of width on the same node); each of that replica's ranks sends the overlap of its
    shard with the needed one. Deterministic: every rank computes the same list."""
    moves: list[Move] = []
    hint = {(layer, dst): src for layer, src, dst in transfers}
    for ranks, layers in stages:
        width = len(ranks)
        for layer in layers:
            src_hint = next((hint[(layer, r)] for r in ranks if (layer, r) in hint), None)
            for j, rank in enumerate(ranks):
                lo, hi = part_range(width, j)
                own = holdings.get(rank, {}).get(layer)
                if own is not None and part_range(*own)[0] <= lo and hi <= part_range(*own)[1]:
                    moves.append((layer, rank, rank, lo, hi))
                    continue
                candidates = ([src_hint] if src_hint is not None else []) + [rank, *ranks]
                replica = next((rep for c in candidates if (rep := _replica(holdings, c, layer)) is not None), None)
                if replica is None:
                    raise RuntimeError(f"layer {layer}: no whole replica to copy rank {rank}'s shard from "
                                       f"(holders: {sorted(r for r, h in holdings.items() if layer in h)})")
                for k, src in enumerate(replica):
                    a, b = part_range(len(replica), k)
                    if max(a, lo) < min(b, hi):
                        moves.append((layer, src, rank, max(a, lo), min(b, hi)))
    return moves


def factored_moves(moves: list[Move], holdings: dict[int, dict[int, Holding]]) -> list[tuple[int, int, int]]:
    """CAME's row/column statistics that go with `moves` (slice_moves): (layer, src, dst) for each layer a
    rank receives, once, in the order of `moves`. They are whole and equal on every rank of a replica, so
    they come whole from one rank of the replica the shard comes from: the receiver itself when it belongs
    to it (src == dst: nothing to send), else the source of its first move."""
    out: list[tuple[int, int, int]] = []
    seen: set[tuple[int, int]] = set()
    for layer, src, dst, _, _ in moves:
        if (layer, dst) in seen:
            continue
        seen.add((layer, dst))
        replica = _replica(holdings, src, layer) or (src,)
        out.append((layer, dst if dst in replica else src, dst))
    return out
